"""DSpark drafting: DFlash's block forward, then the block's drafts one after another, each slot's logits corrected by
the Markov bias of the draft before it (the bonus token for the first) -- DeepSpec's ``sample_block_tokens``, vLLM's
DSpark speculator (the chain and trees: heads/dflash/drafter.py ``ChainedBlockDrafter``).

``--confidence-threshold t`` reads the confidence head: the block is cut after the first draft j whose predicted
survival prod_{i <= j} sigmoid(c_i) -- the chance drafts 1..j are all accepted -- is under t (vLLM's DSpark threshold
reads the same product; as every confidence stop here, the first unsure draft is still verified), so a round verifies
a length the head chose from its own states. A head trained without a confidence head stops on the draft's probability
instead (decode/confidence.py). Either rule reads only the drafter's side: greedy output stays the target's, sampling
stays lossless.
"""

from __future__ import annotations

import torch

from headstart.heads.dflash.drafter import ChainedBlockDrafter
from headstart.heads.dspark.module import DSparkDraft


class DSparkDrafter(ChainedBlockDrafter):
    head: DSparkDraft

    def _slot_logits(self, h: torch.Tensor, unary: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        return self.head.slot_logits(h, self.head.code(prev), unary)

    def _slot_confidence(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        return self.head.confidence(h, self.head.code(prev))
