"""DSpark drafting: DFlash's block forward (heads/dflash/drafter.py), then the block's drafts one after another, each
slot's logits corrected by the Markov bias of the draft before it (the bonus token for the first) -- DeepSpec's
``sample_block_tokens``, vLLM's DSpark speculator.

``--confidence-threshold t`` reads the confidence head: the block is cut after the first draft j whose predicted
survival prod_{i <= j} sigmoid(c_i) -- the chance drafts 1..j are all accepted -- is under t (vLLM's DSpark threshold
reads the same product; as every confidence stop here, the first unsure draft is still verified), so a round verifies
a length the head chose from its own states. A head trained
without a confidence head stops on the draft's probability instead (decode/confidence.py). Either rule reads only the
drafter's side: greedy output stays the target's, sampling stays lossless.

Trees are Medusa's as for DFlash, each child's logits biased by its parent's token. A batch runs row by row.
"""

from __future__ import annotations

import torch

from headstart.decode.confidence import confident_prefix
from headstart.heads.dflash.drafter import DFlashDrafter
from headstart.heads.dspark.module import DSparkDraft


class DSparkDrafter(DFlashDrafter):
    head: DSparkDraft

    @torch.no_grad()
    def _slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The round's block: its normed draft-slot states [D, H] and their lm_head logits [D, V] (no bias yet)."""
        h = self.head.norm(self._block_out())
        return h, self.head.lm_head(h.to(self.head.lm_head_dtype)).float()

    @torch.no_grad()
    def _chain(self, k: int, pick) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Up to k drafts, each picked by ``pick(logits [V]) -> (token [1], row it was drawn from [V])`` after the bias of
        the one before: (tokens [k'], their rows [k', V], confidence logits [k'] or None). No host sync but the stop's."""
        head = self.head
        h, base = self._slots()
        k = min(k, len(h))
        prev = torch.full((1,), self.bonus, dtype=torch.long, device=h.device)
        tokens, rows, confidences = [torch.zeros(0, dtype=torch.long, device=h.device)], [], []
        for j in range(k):
            code = head.code(prev)
            token, row = pick(head.slot_logits(h[j : j + 1], code)[0])
            confidence = head.confidence(h[j : j + 1], code)
            tokens.append(token)
            rows.append(row)
            if confidence is not None:
                confidences.append(confidence)
            prev = token
        tokens, rows = torch.cat(tokens), torch.stack(rows) if rows else base[:0]
        return tokens, rows, torch.cat(confidences) if confidences else None

    def _kept(self, tokens: torch.Tensor, rows: torch.Tensor, confidences: torch.Tensor | None,
              probs: bool = False) -> int:
        """How many drafts the round verifies under ``confidence_threshold``."""
        t = self.confidence_threshold
        if t <= 0 or tokens.numel() == 0:
            return tokens.numel()
        if confidences is None:  # no confidence head: the draft's own probability (decode/confidence.py)
            return confident_prefix(rows.log() if probs else rows, tokens, t)
        survival = torch.sigmoid(confidences).cumprod(0)
        # up to and with the first draft under t (decode/confidence.py's rule: the first unsure draft is still verified)
        return min(int((survival >= t).sum()) + 1, tokens.numel())  # a running product: the sure ones are a prefix

    @torch.no_grad()
    def propose(self, k: int) -> torch.Tensor:
        tokens, rows, confidences = self._chain(k, lambda logits: (logits.argmax(-1, keepdim=True), logits))
        return tokens[: self._kept(tokens, rows, confidences)]

    @torch.no_grad()
    def propose_sampled(self, k: int, sampling, generator: torch.Generator | None = None):
        """Each draft sampled from its slot's warped, Markov-corrected distribution: (tokens [k'], q [k', V])."""
        def pick(logits: torch.Tensor):
            q = sampling.probs(logits.unsqueeze(0))[0]
            return torch.multinomial(q, 1, generator=generator), q

        tokens, q, confidences = self._chain(k, pick)
        kept = self._kept(tokens, q, confidences, probs=True)
        return tokens[:kept], q[:kept]

    # -- trees: DFlash's, each child biased by its parent's token ---------------------------------------------
    def tree_root(self) -> torch.Tensor:
        self.tree_h, self.tree_logits = self._slots()
        prev = torch.full((1,), self.bonus, dtype=torch.long, device=self.tree_h.device)
        return self.head.slot_logits(self.tree_h[:1], self.head.code(prev))[0]

    def tree_expand(self, parents: torch.Tensor, tokens: torch.Tensor, depth: int) -> torch.Tensor:
        """The children of m nodes at ``depth``: slot depth+1's logits, biased by each node's own token."""
        super().tree_expand(parents, tokens, depth)  # its depth check
        h = self.tree_h[depth].expand(tokens.numel(), -1)
        return self.head.slot_logits(h, self.head.code(tokens))
