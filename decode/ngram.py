"""Prompt-lookup drafting (n-gram): no model; propose what followed the last earlier occurrence of
the context's longest matching suffix. Strong on summarisation, RAG and code edits."""

from __future__ import annotations

import torch


class NgramDrafter:
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes: need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.context: list[int] = []

    def begin(self, prompt_ids: torch.Tensor, states, next_token: int) -> None:
        self.context = prompt_ids[0].tolist() + [next_token]

    def propose(self, k: int) -> torch.Tensor:
        """Up to k draft tokens (possibly none) continuing ``self.context``."""
        ctx = self.context
        for n in range(min(self.max_ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            suffix = ctx[-n:]
            # Latest earlier occurrence first: recent text predicts best.
            for start in range(len(ctx) - n - 1, -1, -1):
                if ctx[start : start + n] == suffix:
                    follow = ctx[start + n : start + n + k]
                    if follow:
                        return torch.tensor(follow, dtype=torch.long)
        return torch.empty(0, dtype=torch.long)

    def update(self, emitted: list[int], states) -> None:
        self.context += emitted
