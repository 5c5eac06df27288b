"""Medusa drafting for a batch: every head runs once per round on the stacked last states of all rows.

As the one-sequence drafter (heads/medusa/drafter.py): after each verification row b's target state at its last
accepted position is read, and the top-1 of heads 1..k is its chain.
"""

from __future__ import annotations

import torch

from headstart.heads.medusa.module import MedusaHeads
from headstart.models.target import TargetOutput


class MedusaBatchDrafter:
    def __init__(self, heads: MedusaHeads, max_len: int = 0, batch: int = 1, compile: bool = False,
                 backend: str = "inductor") -> None:
        # No cache to size, and nothing to compile: a round is one ResBlock and lm_head per head over [B, H] -- a few
        # ops -- so ``compile`` is accepted (the registry's batch drafters share a signature) and runs it eagerly.
        self.heads = heads.eval()
        self.num_heads = heads.config.num_heads
        self.token_map = heads.token_map  # [V'] target ids of a truncated vocab, or None
        self.drafts: torch.Tensor | None = None  # [B, K] each head's top-1 for every row, as target ids

    @torch.no_grad()
    def _read(self, states: TargetOutput, counts: list[int]) -> None:
        """Row b's state at its counts[b]-th position: the one that produced its last emitted token."""
        hidden = states.last_hidden_state
        last = hidden[torch.arange(hidden.shape[0], device=hidden.device), torch.tensor(counts, device=hidden.device) - 1]
        ids = self.heads.head_logits(last).argmax(-1).T  # [B, K]
        self.drafts = ids if self.token_map is None else self.token_map[ids]

    def begin(self, prompts: list[torch.Tensor], states: TargetOutput, next_tokens: list[int]) -> None:
        self._read(states, [p.shape[1] for p in prompts])

    def update(self, emitted: list[list[int]], states: TargetOutput) -> None:
        self._read(states, [len(e) for e in emitted])

    def propose(self, budgets: list[int]) -> list[torch.Tensor]:
        return [self.drafts[b, : min(k, self.num_heads)] for b, k in enumerate(budgets)]

    def select(self, rows: list[int]) -> None:
        self.drafts = self.drafts[torch.tensor(rows, dtype=torch.long, device=self.drafts.device)]
