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

from headstart.decode.drafter import Capabilities, Drafter
from headstart.decode.ngram_store import Follows, NgramStore, count_follows
from headstart.decode.tree import DraftTree, DynamicTree


def likeliest(follow: dict[int, list[int]], topk: int) -> list[tuple[int, float]]:
    """The ``topk`` most frequent followers with their share of the counts (ties: the most recently seen first)."""
    total = sum(seen[0] for seen in follow.values())
    best = sorted(follow.items(), key=lambda item: (-item[1][0], -item[1][1]))[:topk]
    return [(token, seen[0] / total) for token, seen in best]


def prompt_lookup(context: list[int], k: int, max_ngram: int, min_ngram: int = 1) -> list[int]:
    """Up to k tokens (possibly none) that followed the latest earlier occurrence of the context's longest suffix of
    ``min_ngram``..``max_ngram`` tokens."""
    for n in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
        suffix = context[-n:]
        # Latest earlier occurrence first: recent text predicts best.
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == suffix:
                follow = context[start + n : start + n + k]
                if follow:
                    return follow
    return []


class CountTree(Drafter):
    """Trees and chains grown from counts: a subclass gives ``children(path, topk)`` -- the likeliest tokens after the
    context and a path, with their probabilities -- and ``device``; this grows the likeliest nodes best first (n-gram
    lookup here; REST's datastore, decode/rest.py)."""

    device: torch.device

    def children(self, path: tuple[int, ...], topk: int) -> list[tuple[int, float]]:
        raise NotImplementedError

    def scored_chain(self, k: int) -> tuple[torch.Tensor, float]:
        """Up to k drafts grown token by token from the counts (a tree of one branch; on the host, as ``propose``'s
        span: the loop moves drafts), and their expected accepted count (``scored_tree``)."""
        tokens, _, _, score = self._grow(DynamicTree(depth=max(k, 1), topk=1, total_tokens=max(k, 1)), k)
        return torch.tensor(tokens, dtype=torch.long), score

    def grow_tree(self, spec: DynamicTree, max_depth: int) -> DraftTree:
        """A draft tree of at most ``spec.total_tokens`` nodes, ``min(spec.depth, max_depth)`` levels and ``spec.topk``
        children a node: the likeliest nodes (product of their path's probabilities under ``children``), added best
        first -- a child is never likelier than its parent, so the kept nodes are always a tree, in topological order."""
        return self.scored_tree(spec, max_depth)[0]

    def scored_tree(self, spec: DynamicTree, max_depth: int) -> tuple[DraftTree, float]:
        """``grow_tree``'s tree and the drafts it expects accepted: the sum of its nodes' path probabilities under the
        counts (a node is accepted with its path's probability) -- SuffixDecoding's score of a speculation."""
        tokens, parents, depths, score = self._grow(spec, max_depth)
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=self.device)  # noqa: E731
        return DraftTree(as_tensor(tokens), as_tensor(parents), as_tensor(depths), max(depths, default=0)), score

    def _grow(self, spec: DynamicTree, max_depth: int) -> tuple[list[int], list[int], list[int], float]:
        """``grow_tree``'s nodes as lists -- tokens, parents (-1 = the root), depths -- and ``scored_tree``'s score."""
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
            if len(tokens) < spec.total_tokens:  # a full tree looks nothing more up
                push(len(tokens) - 1)
        return tokens, parents, [len(path) for path in paths], sum(math.exp(logp) for logp in logps)


class NgramDrafter(CountTree):
    """``store``: a datastore of the target's replies (decode/ngram_store.py), looked up where the request's own
    tokens have no suffix match as long; chains then grow token by token (a tree of one branch)."""

    # Its own dynamic trees (no logits to rank: no static trees); a batch row by row (decode/batch_generate.py PerSequence).
    capabilities = Capabilities(trees=("dynamic",), batches=True)

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, store: NgramStore | None = None, learn: bool = False
                 ) -> None:
        """``learn``: the store also counts every token the target generates here, as it is verified (SuffixDecoding's
        global tree grows with the responses it serves), for the requests after this one."""
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes: need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        if learn and store is None:
            raise ValueError("learn counts generated tokens into a store: pass store= (an empty NgramStore() will do)")
        self.max_ngram, self.min_ngram, self.store, self.learn = max_ngram, min_ngram, store, learn
        self.learned_upto = 0  # the context's tokens from here on are not yet learned (none of the prompt's ever are)
        self.context: list[int] = []
        self.follows: Follows = defaultdict(dict)  # over the context: what trees look up
        self.device = torch.device("cpu")

    def begin(self, prompt_ids: torch.Tensor, states, next_token: int) -> None:
        self.context, self.follows = [], defaultdict(dict)
        self.device = prompt_ids.device
        self.learned_upto = prompt_ids.shape[1]
        self._extend(prompt_ids[0].tolist() + [next_token])

    def propose(self, k: int) -> torch.Tensor:
        """Up to k draft tokens (possibly none) continuing ``self.context``."""
        if self.store is not None:
            return self.scored_chain(k)[0]
        return torch.tensor(prompt_lookup(self.context, k, self.max_ngram, self.min_ngram), dtype=torch.long)

    def update(self, emitted: list[int], states) -> None:
        self._extend(emitted)
        if self.learn:  # generated tokens, once verified: a request that stops before its first round teaches nothing
            self.store.learn(self.context, self.learned_upto)
            self.learned_upto = len(self.context)

    def finish(self, emitted: list[int], states) -> None:
        """The request's last round (decode/generate.py calls no ``update`` for it): learned too, when learning."""
        if self.learn:
            self.update(emitted, None)

    def _extend(self, tokens: list[int]) -> None:
        """Append tokens to the context and count the n-grams each new token follows."""
        old = len(self.context)
        self.context += tokens
        count_follows(self.follows, self.context, old, self.min_ngram, self.max_ngram)

    def children(self, path: tuple[int, ...], topk: int) -> list[tuple[int, float]]:
        """The likeliest ``topk`` tokens after context + ``path``: (token, probability), from what followed the longest
        suffix of it seen before -- in the request itself, else in the store (at equal length the request wins)."""
        longest = max(self.max_ngram, self.store.max_ngram if self.store is not None else 0)
        tail = self.context[-longest:] + list(path)
        for n in range(min(longest, len(tail)), 0, -1):
            key = tuple(tail[-n:])
            if self.min_ngram <= n <= self.max_ngram and key in self.follows:
                return likeliest(self.follows[key], topk)
            found = self.store.lookup(key, topk) if self.store is not None else None
            if found:
                return found
        return []
