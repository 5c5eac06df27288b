"""The toy head's drafter: a chain from the target's state at the bonus token's position, the cell applied once per
draft. Its drafts do not read the tokens drafted before them (as Medusa's), so it drafts chains only; the chain
itself -- greedy, sampled with q, the confidence stop -- is decode/chain.py's."""

from __future__ import annotations

import torch

from headstart.decode.batch_generate import RowByRow
from headstart.decode.chain import ChainDrafter
from headstart.decode.drafter import Capabilities
from headstart.models.target import TargetOutput

from toy_head.module import ToyHead


class ToyDrafter(RowByRow, ChainDrafter):
    capabilities = Capabilities(batches=True, sampled=True, confidence=True)

    def __init__(self, head: ToyHead, max_len: int = 0, compile: bool = False, backend: str = "inductor") -> None:
        self.head, self.max_len = head.eval(), max_len
        self.device, self.target_vocab_size = head.lm_head.weight.device, head.vocab_size
        self.hidden: torch.Tensor | None = None  # [H] the target's state that produced the bonus token

    def begin(self, prompt_ids: torch.Tensor, states: TargetOutput, next_token: int) -> None:
        self.hidden = states.last_hidden_state[0, -1]

    def update(self, emitted: list[int], states: TargetOutput) -> None:
        self.hidden = states.last_hidden_state[0, len(emitted) - 1]

    def chain_room(self, k: int) -> int:
        self._z = self.hidden.to(self.head.lm_head.weight.dtype)  # what each step advances
        return min(k, self.head.num_steps)

    def chain_logits(self, i: int, previous: torch.Tensor | None) -> torch.Tensor:
        self._z = self.head.advance(self._z)
        return self.head.lm_head(self._z).float()

    def row_drafter(self) -> "ToyDrafter":
        return ToyDrafter(self.head, self.max_len)
