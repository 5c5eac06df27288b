"""Prompt-lookup drafting (n-gram): no model; propose what followed earlier occurrences of the context's longest
matching suffix. Strong on summarisation, RAG and code edits.

Chains copy the span after the suffix's latest earlier occurrence (transformers' and vLLM's prompt lookup). Trees
(``grow_tree``) branch where the context continued the same suffix in different ways: every node's children are the
tokens that followed its path's longest matching suffix, weighted by how often (the frequency tree of SuffixDecoding,
Oliaro et al. 2024, over the request's own tokens), and the tree keeps the likeliest nodes."""

from __future__ import annotations

import heapq
import itertools
import math
from collections import defaultdict

import torch

from headstart.decode.tree import DraftTree, DynamicTree


class NgramDrafter:
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes: need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.context: list[int] = []
        # n-gram -> {next token: [times seen, last position]}, over the context (what trees look up)
        self.follows: dict[tuple[int, ...], dict[int, list[int]]] = defaultdict(dict)
        self.device = torch.device("cpu")

    def begin(self, prompt_ids: torch.Tensor, states, next_token: int) -> None:
        self.context, self.follows = [], defaultdict(dict)
        self.device = prompt_ids.device
        self._extend(prompt_ids[0].tolist() + [next_token])

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
        self._extend(emitted)

    def _extend(self, tokens: list[int]) -> None:
        """Append tokens to the context and count the n-grams each new token follows."""
        ctx = self.context
        old = len(ctx)
        ctx += tokens
        for j in range(max(old, 1), len(ctx)):  # ctx[j] follows the n-grams ending at j - 1
            for n in range(self.min_ngram, min(self.max_ngram, j) + 1):
                seen = self.follows[tuple(ctx[j - n : j])].setdefault(ctx[j], [0, 0])
                seen[0] += 1
                seen[1] = j

    def children(self, path: tuple[int, ...], topk: int) -> list[tuple[int, float]]:
        """The likeliest ``topk`` tokens after context + ``path``: (token, probability), from what followed the longest
        suffix of it seen before (ties: the most recently seen first)."""
        tail = self.context[-self.max_ngram :] + list(path)
        for n in range(min(self.max_ngram, len(tail)), self.min_ngram - 1, -1):
            follow = self.follows.get(tuple(tail[-n:]))
            if follow:
                total = sum(seen[0] for seen in follow.values())
                best = sorted(follow.items(), key=lambda item: (-item[1][0], -item[1][1]))[:topk]
                return [(token, seen[0] / total) for token, seen in best]
        return []

    def grow_tree(self, spec: DynamicTree, max_depth: int) -> DraftTree:
        """A draft tree of at most ``spec.total_tokens`` nodes, ``min(spec.depth, max_depth)`` levels and ``spec.topk``
        children a node: the likeliest nodes (product of their path's probabilities under ``children``), added best
        first -- a child is never likelier than its parent, so the kept nodes are always a tree, in topological order."""
        depth = min(spec.depth, max_depth)
        tokens, parents, paths, logps = [], [], [], []
        frontier: list[tuple[float, int, int, int]] = []  # (-log p, push order, parent node or -1, token)
        pushed = itertools.count()  # ties: the likelier sibling, then the shallower node, first

        def push(parent: int) -> None:
            path, logp = (paths[parent], logps[parent]) if parent >= 0 else ((), 0.0)
            if len(path) < depth:
                for token, prob in self.children(path, spec.topk):
                    heapq.heappush(frontier, (-(logp + math.log(prob)), next(pushed), parent, token))

        push(-1)
        while frontier and len(tokens) < spec.total_tokens:
            neg_logp, _, parent, token = heapq.heappop(frontier)
            tokens.append(token)
            parents.append(parent)
            paths.append((paths[parent] if parent >= 0 else ()) + (token,))
            logps.append(-neg_logp)
            push(len(tokens) - 1)
        depths = [len(path) for path in paths]
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=self.device)  # noqa: E731
        return DraftTree(as_tensor(tokens), as_tensor(parents), as_tensor(depths), max(depths, default=0))
