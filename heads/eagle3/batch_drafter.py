"""EAGLE-3 drafting for a batch of sequences of different lengths: one draft forward per step for every row.

The same steps as the one-sequence drafter (heads/eagle3/drafter.py) -- a committed pair (f_j, x_{j+1}) per
position in the draft's own KV cache, draft step i >= 1 at rotary position t + i attending to the committed keys
and its own earlier steps -- with each row's committed length its own, as in the target's ``StaticRaggedKVCache``: row
b writes at its own slots, its padding (a shorter prompt, fewer accepted tokens) attends only to itself and is
never attended to, and its speculative slots past its length are overwritten by its next commit. The layer runs
through ``RaggedBlocks`` (decode/ragged_blocks.py): eagerly, or with ``compile`` as compiled graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from headstart.decode.batch_generate import padded_rows, shifted_prompts
from headstart.decode.ragged_blocks import RaggedBlocks
from headstart.heads.eagle3.module import Eagle3Draft
from headstart.models.target import TargetOutput


class Eagle3BatchDrafter:
    def __init__(self, head: Eagle3Draft, max_len: int, batch: int, compile: bool = False,
                 backend: str = "inductor") -> None:
        self.head = head.eval()
        self.max_len = max_len
        self.device = head.fc.weight.device
        self.blocks = RaggedBlocks(self._layer, max_len, self.device, compile, backend)
        self.blocks.reset(batch)
        self.last_hidden: torch.Tensor | None = None  # [B, 1, H] output at each row's last committed position
        self.last_logits: torch.Tensor | None = None  # [B, V_d]

    @property
    def lengths(self) -> list[int]:
        """Committed draft positions per row."""
        return self.blocks.lengths

    def precompile(self, batch: int, max_block: int) -> None:
        """With ``compile``: the layer's blocks of 1..max_block pairs (a commit of k + 1, a draft step's 1) for ``batch``
        rows, compiled now."""
        self.blocks.precompile(batch, range(1, max_block + 1), self.head.config.hidden_size, self.head.fc.weight.dtype)

    def _layer(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
               cache) -> torch.Tensor:
        """``RaggedBlocks``' step: the draft layer on pairs, its attention reading the cache's visible slots."""
        layer = cache.layers[0]

        def cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys, values = layer.update(k, v)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed.unsqueeze(1))

        return self.head.step(hidden, tokens, positions, cached)

    @torch.no_grad()
    def _step(self, hidden: torch.Tensor, tokens: torch.Tensor, starts: list[int], valid: list[int]) -> torch.Tensor:
        """The draft layer on pairs (hidden [B, n, H], tokens [B, n]); row b's first valid[b] written at slots
        starts[b]... and attending causally to everything before them. Returns the layer output [B, n, H]."""
        return self.blocks(hidden, tokens, starts, valid)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.lm_head(self.head.norm(hidden))

    @torch.no_grad()
    def _commit(self, aux_hidden: torch.Tensor, tokens: torch.Tensor, counts: list[int]) -> None:
        """Row b's next counts[b] pairs: aux [B, n, k*H], tokens [B, n] (padded past counts[b])."""
        hidden = self.head.fc(aux_hidden.to(self.head.fc.weight.dtype))
        out = self._step(hidden, tokens, self.lengths, counts)
        self.blocks.commit(counts)
        last = torch.tensor(counts, device=out.device) - 1
        self.last_hidden = out[torch.arange(out.shape[0], device=out.device), last].unsqueeze(1)
        self.last_logits = self._logits(self.last_hidden)[:, -1]

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.head.d2t[draft_ids]

    def begin(self, prompts: list[torch.Tensor], states: TargetOutput, next_tokens: list[int]) -> None:
        """Prompts [1, T_b] each, the target's states over the right-padded batch [B, T_max, ...], first tokens."""
        tokens, counts = shifted_prompts(prompts, next_tokens)
        self.blocks.reset(len(prompts))
        self._commit(states.aux_hidden_states[:, : max(counts)], tokens, counts)

    def _draft(self, steps: int, pick) -> torch.Tensor:
        """``steps`` draft steps for every row; ``pick(logits [B, V_d]) -> draft ids [B]``. Returns target ids [B, steps]."""
        tokens: list[torch.Tensor] = []
        hidden, logits = self.last_hidden, self.last_logits
        for i in range(steps):
            if i > 0:  # speculative slots after each row's committed ones
                hidden = self._step(hidden, tokens[-1][:, None], [n - 1 + i for n in self.lengths], [1] * len(self.lengths))
                logits = self._logits(hidden)[:, -1]
            tokens.append(self.to_target(pick(logits)))
        if not tokens:
            return torch.empty(len(self.lengths), 0, dtype=torch.long, device=self.device)
        return torch.stack(tokens, dim=1)

    @torch.no_grad()
    def propose(self, budgets: list[int]) -> list[torch.Tensor]:
        drafts = self._draft(max(budgets), lambda logits: logits.argmax(-1))
        return [drafts[b, :k] for b, k in enumerate(budgets)]

    @torch.no_grad()
    def propose_sampled(self, budgets: list[int], sampling, generator: torch.Generator | None = None):
        """Drafts sampled from the warped draft distribution: per row (tokens [k_b], q [k_b, V]), q over the target
        vocab (zero outside the draft vocab)."""
        q_steps: list[torch.Tensor] = []

        def pick(logits: torch.Tensor) -> torch.Tensor:
            q_steps.append(sampling.probs(logits))  # [B, V_d]
            return torch.multinomial(q_steps[-1], 1, generator=generator).squeeze(1)

        drafts = self._draft(max(budgets), pick)
        B, steps = drafts.shape
        q = torch.zeros(B, steps, self.head.config.vocab_size, device=self.device)
        if q_steps:
            q[:, :, self.head.target_vocab_ids()] = torch.stack(q_steps, dim=1)
        return [drafts[b, :k] for b, k in enumerate(budgets)], [q[b, :k] for b, k in enumerate(budgets)]

    def update(self, emitted: list[list[int]], states: TargetOutput) -> None:
        """Row b's emitted tokens and the target's states [B, n_max, ...] of the positions that produced them."""
        tokens, counts = padded_rows(emitted, self.device)
        self._commit(states.aux_hidden_states[:, : max(counts)], tokens, counts)

    def select(self, rows: list[int]) -> None:
        """Keep only these rows, in this order (finished sequences leave the batch)."""
        self.blocks.select(rows)
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.last_hidden, self.last_logits = self.last_hidden[index], self.last_logits[index]
