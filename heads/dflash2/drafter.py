"""DFlash2 drafting: DFlash's block forward, then the block's slots one after another, each slot's draft the candidate
selector's best of its top-k given the draft before it (z-lab's ``DFlash2DraftModel.propose``; sampled: drawn from the
warped scores over the candidates, z-lab's q scattered onto the vocab). The chain and trees:
heads/dflash/drafter.py ``ChainedBlockDrafter``."""

from __future__ import annotations

import torch

from headstart.heads.dflash.drafter import ChainedBlockDrafter
from headstart.heads.dflash2.module import DFlash2Draft


class DFlash2Drafter(ChainedBlockDrafter):
    head: DFlash2Draft

    def _slot_logits(self, h: torch.Tensor, unary: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        return self.head.candidate_selector.logits(h, unary, prev)
