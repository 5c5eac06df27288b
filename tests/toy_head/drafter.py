"""The toy head's drafter: a chain from the target's state at the bonus token's position, the cell applied once per
draft. Its drafts do not read the tokens drafted before them (as Medusa's), so it drafts chains only."""

from __future__ import annotations

import torch

from headstart.decode.batch_generate import RowByRow
from headstart.decode.drafter import Capabilities
from headstart.models.target import TargetOutput

from toy_head.module import ToyHead


class ToyDrafter(RowByRow):
    capabilities = Capabilities(batches=True, sampled=True)

    def __init__(self, head: ToyHead, max_len: int = 0, compile: bool = False, backend: str = "inductor") -> None:
        self.head, self.max_len = head.eval(), max_len
        self.hidden: torch.Tensor | None = None  # [H] the target's state that produced the bonus token

    def begin(self, prompt_ids: torch.Tensor, states: TargetOutput, next_token: int) -> None:
        self.hidden = states.last_hidden_state[0, -1]

    def update(self, emitted: list[int], states: TargetOutput) -> None:
        self.hidden = states.last_hidden_state[0, len(emitted) - 1]

    @torch.no_grad()
    def _chain(self, k: int, pick) -> torch.Tensor:
        z, drafts = self.hidden.to(self.head.lm_head.weight.dtype), []
        for _ in range(min(k, self.head.num_steps)):
            z = self.head.advance(z)
            drafts.append(pick(self.head.lm_head(z).float()))
        return torch.stack(drafts) if drafts else torch.zeros(0, dtype=torch.long, device=z.device)

    def propose(self, k: int) -> torch.Tensor:
        return self._chain(k, lambda logits: logits.argmax())

    def propose_sampled(self, k: int, sampling, generator: torch.Generator | None = None):
        qs = []

        def draw(logits: torch.Tensor) -> torch.Tensor:
            qs.append(sampling.probs(logits.unsqueeze(0))[0])
            return torch.multinomial(qs[-1], 1, generator=generator).view(())

        drafts = self._chain(k, draw)
        return drafts, torch.stack(qs) if qs else torch.zeros(0, self.head.vocab_size)

    def row_drafter(self) -> "ToyDrafter":
        return ToyDrafter(self.head, self.max_len)
