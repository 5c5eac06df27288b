"""MTP drafting for a batch of sequences of different lengths: one pass of the MTP layer per step for every row.

The steps of the one-sequence drafter (heads/mtp/drafter.py) -- committed pairs (h_j, x_{j+1}) at rotary position
j in the layer's own KV cache, draft step i >= 1 one position further, attending to the committed keys and its own
earlier steps -- on a ragged cache of one layer (``RaggedBlocks``, decode/ragged_blocks.py: eager, or with ``compile``
compiled graphs): row b's committed length is its own, its padding attends only to itself and is never attended to,
and its speculative slots are overwritten by its next commit.
"""

from __future__ import annotations

import torch

from headstart.decode.batch_generate import padded_rows, shifted_prompts
from headstart.decode.ragged_blocks import RaggedBlocks
from headstart.heads.mtp.module import MTPHead
from headstart.models.target import TargetOutput, additive_mask


class MTPBatchDrafter:
    def __init__(self, head: MTPHead, max_len: int, batch: int, compile: bool = False,
                 backend: str = "inductor") -> None:
        self.head = head.eval()
        self.max_len = max_len
        self.device = head.eh_proj.weight.device
        self.blocks = RaggedBlocks(self._layer, max_len, self.device, compile, backend)
        self.blocks.reset(batch)
        self.last_hidden: torch.Tensor | None = None  # [B, 1, H] the layer's output at each row's last committed pair
        self.last_logits: torch.Tensor | None = None  # [B, V]

    def precompile(self, batch: int, max_block: int) -> None:
        """With ``compile``: the layer's blocks of 1..max_block pairs for ``batch`` rows, compiled now."""
        self.blocks.precompile(batch, range(1, max_block + 1), self.head.eh_proj.out_features, self.head.eh_proj.weight.dtype)

    def _layer(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
               cache) -> torch.Tensor:
        """``RaggedBlocks``' step: the MTP layer on pairs (hidden [B, n, H], tokens [B, n]) at rotary ``positions``."""
        x = self.head.fuse(tokens, hidden, positions)
        return self.head.layer(x, positions, additive_mask(allowed, x.dtype), cache)

    @torch.no_grad()
    def _step(self, hidden: torch.Tensor, tokens: torch.Tensor, starts: list[int], valid: list[int]) -> torch.Tensor:
        """The layer on pairs (hidden [B, n, H], tokens [B, n]); row b's first valid[b] at slots (= positions)
        starts[b]..., attending causally to everything before them. Returns the outputs [B, n, H]."""
        return self.blocks(hidden, tokens, starts, valid)

    @torch.no_grad()
    def _commit(self, hidden: torch.Tensor, tokens: torch.Tensor, counts: list[int]) -> None:
        """Row b's next counts[b] pairs: hidden [B, n, H], tokens [B, n] (padded past counts[b])."""
        out = self._step(hidden, tokens, self.blocks.lengths, counts)
        self.blocks.commit(counts)
        last = torch.tensor(counts, device=out.device) - 1
        self.last_hidden = out[torch.arange(out.shape[0], device=out.device), last].unsqueeze(1)
        self.last_logits = self.head.logits(self.last_hidden)[:, -1].float()

    def begin(self, prompts: list[torch.Tensor], states: TargetOutput, next_tokens: list[int]) -> None:
        """Prompts [1, T_b] each, the target's states over the right-padded batch [B, T_max, ...], first tokens."""
        tokens, counts = shifted_prompts(prompts, next_tokens)
        self.blocks.reset(len(prompts))
        self._commit(states.last_hidden_state[:, : max(counts)], tokens.to(self.device), counts)

    @torch.no_grad()
    def propose(self, budgets: list[int]) -> list[torch.Tensor]:
        """Up to budgets[b] greedy drafts for row b: step i feeds back step i-1's output and draft."""
        tokens: list[torch.Tensor] = []
        hidden, logits = self.last_hidden, self.last_logits
        lengths = self.blocks.lengths
        for i in range(max(budgets)):
            if i > 0:  # speculative slots after each row's committed ones
                hidden = self._step(hidden, tokens[-1][:, None], [n - 1 + i for n in lengths], [1] * len(lengths))
                logits = self.head.logits(hidden)[:, -1]
            tokens.append(logits.argmax(-1))
        drafts = torch.stack(tokens, dim=1) if tokens else torch.empty(len(lengths), 0, dtype=torch.long, device=self.device)
        return [drafts[b, :k] for b, k in enumerate(budgets)]

    def update(self, emitted: list[list[int]], states: TargetOutput) -> None:
        """Row b's emitted tokens and the target's states [B, n_max, ...] of the positions that produced them."""
        tokens, counts = padded_rows(emitted, self.device)
        self._commit(states.last_hidden_state[:, : max(counts)], tokens, counts)

    def select(self, rows: list[int]) -> None:
        """Keep only these rows, in this order (finished sequences leave the batch)."""
        self.blocks.select(rows)
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.last_hidden, self.last_logits = self.last_hidden[index], self.last_logits[index]
