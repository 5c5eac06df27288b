"""EAGLE-3 drafting at inference, consistent with its training-time test.

Draft position j pairs the target's aux feature f_j with token x_{j+1}, and its output predicts
x_{j+2}. Committed pairs live in the draft's own KV cache (one layer). To propose k tokens from
the last committed position t, step i (i >= 1) feeds back the previous step's hidden output with
the token just drafted, at rotary position t + i, attending to the committed keys plus the keys of
its own earlier steps -- the same attention pattern and positions as TTT step i.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from headstart.models.eagle3 import Eagle3Draft


class Eagle3Drafter:
    def __init__(self, head: Eagle3Draft, max_len: int) -> None:
        self.head = head.eval()
        c = head.config
        self.max_len = max_len
        device, dtype = head.fc.weight.device, head.fc.weight.dtype
        self.keys = torch.zeros(1, c.num_attention_heads, max_len, c.head_dim, device=device, dtype=dtype)
        self.values = torch.zeros_like(self.keys)
        self.length = 0  # committed draft positions
        self.last_hidden: torch.Tensor | None = None  # [1, 1, H] output at the last committed position
        self.last_logits: torch.Tensor | None = None  # [1, V_d]

    @torch.no_grad()
    def _step(self, hidden: torch.Tensor, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Run the draft layer on n pairs (hidden [1, n, H], tokens [1, n]) written at slots
        [start, start+n) with rotary positions start..start+n-1; returns the layer output [1, n, H]."""
        head, n = self.head, tokens.shape[1]
        end = start + n
        if end > self.max_len:
            raise ValueError(f"draft KV cache overflow: {end} > max_len {self.max_len}")
        positions = torch.arange(start, end, device=hidden.device).unsqueeze(0)
        cos, sin = head.rotary_emb(hidden, positions)
        embeds = head.embed_tokens(tokens).to(hidden.dtype)
        q, k, v = head.midlayer.self_attn.qkv(head.midlayer.attn_input(embeds, hidden), cos, sin)
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        allowed = torch.ones(n, end, dtype=torch.bool, device=hidden.device)
        allowed[:, start:] = torch.ones(n, n, dtype=torch.bool, device=hidden.device).tril()
        out = F.scaled_dot_product_attention(q, self.keys[:, :, :end], self.values[:, :, :end], attn_mask=allowed)
        attn = head.midlayer.self_attn.o_proj(out.transpose(1, 2).reshape(1, n, -1))
        return head.midlayer.finish(hidden, attn)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.lm_head(self.head.norm(hidden))

    def _commit(self, aux_hidden: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Pairs (f_j, x_{j+1}) for the next n positions: aux [1, n, k*H], tokens [1, n]."""
        hidden = self.head.fc(aux_hidden.to(self.head.fc.weight.dtype))
        out = self._step(hidden, next_tokens, self.length)
        self.length += next_tokens.shape[1]
        self.last_hidden = out[:, -1:]
        self.last_logits = self._logits(self.last_hidden)[:, -1]

    def _to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.head.d2t[draft_ids]

    def begin(self, prompt_ids: torch.Tensor, aux_hidden: torch.Tensor, next_token: int) -> None:
        self.length = 0
        tokens = torch.cat([prompt_ids[:, 1:], torch.tensor([[next_token]], device=prompt_ids.device)], dim=1)
        self._commit(aux_hidden, tokens)

    def _draft(self, k: int, pick) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """k draft steps from the last committed position; ``pick(logits [1, V_d]) -> draft id [1]``.
        Returns target ids [k] and the draft logits of each step."""
        tokens, step_logits = [], []
        hidden, logits = self.last_hidden, self.last_logits
        for i in range(k):
            if i > 0:
                # Speculative slots after the committed ones; overwritten by the next commit.
                hidden = self._step(hidden, tokens[-1].view(1, 1), self.length - 1 + i)
                logits = self._logits(hidden)[:, -1]
            step_logits.append(logits)
            tokens.append(self._to_target(pick(logits)))
        if not tokens:
            return torch.empty(0, dtype=torch.long, device=self.keys.device), []
        return torch.cat(tokens), step_logits

    @torch.no_grad()
    def propose(self, k: int) -> torch.Tensor:
        return self._draft(k, lambda logits: logits.argmax(-1))[0]

    @torch.no_grad()
    def propose_sampled(self, k: int, sampling, generator: torch.Generator | None = None):
        """Drafts sampled from the warped draft distribution; returns (tokens [k], q [k, V]) with
        q over the target vocab (zero outside the draft vocab)."""
        q_steps: list[torch.Tensor] = []

        def pick(logits: torch.Tensor) -> torch.Tensor:
            q_steps.append(sampling.probs(logits))  # [1, V_d]
            return torch.multinomial(q_steps[-1], 1, generator=generator).view(1)

        tokens, _ = self._draft(k, pick)
        q = torch.zeros(len(q_steps), self.head.config.vocab_size, device=self.keys.device)
        if q_steps:
            q[:, self.head.target_vocab_ids()] = torch.cat(q_steps)
        return tokens, q

    def update(self, emitted: list[int], aux_hidden: torch.Tensor) -> None:
        self._commit(aux_hidden, torch.tensor([emitted], device=aux_hidden.device))
