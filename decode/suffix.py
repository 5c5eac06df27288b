"""Suffix decoding (SuffixDecoding, Oliaro et al., 2024; vLLM's ``method: "suffix"`` through Arctic Inference): drafts
from suffix trees of what the target has already read and written -- no model, no training, lossless.

Each request drafts from two trees (decode/suffix_tree.py): its own, over its prompt and reply so far (the copying
n-gram lookup does), and a global one over the replies of the requests served before it and of this one as it grows
(the phrasing a model repeats across requests). Each round, each tree proposes its best-scoring continuation of the
context's suffix -- a path for a chain, a tree for ``--tree`` -- at most ``spec_factor`` drafts per token matched (the
adaptive speculation length: a long match earns a long draft), cut where the estimated probability falls under
``min_prob``; the higher score wins. A REST datastore (``--datastore``: the target's replies to a recipe's prompts, as
a server's earlier traffic) is a third source, read at its longest match.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from headstart.decode.drafter import Capabilities, Drafter
from headstart.decode.rest import Datastore
from headstart.decode.suffix_tree import Speculation, SuffixTree, from_match, speculate
from headstart.decode.tree import DraftTree, DynamicTree


@dataclass(frozen=True)
class SuffixParams:
    """vLLM's ``suffix_decoding_*`` settings, with its defaults."""

    max_depth: int = 24
    """The trees' depth: the longest suffix matched plus what is drafted after it (``max_tree_depth``)."""
    spec_factor: float = 1.0
    """Drafts per matched token (``max_spec_factor``)."""
    spec_offset: float = 0.0
    """Drafts granted besides (Arctic's ``max_spec_offset``)."""
    min_prob: float = 0.1
    """A draft's estimated probability (its path's count ratios multiplied) below this ends it (``min_token_prob``)."""
    max_cached: int = 10000
    """Replies the global tree holds, oldest evicted first; 0: no global tree (``max_cached_requests``)."""

    def __post_init__(self) -> None:
        if self.max_depth < 2:
            raise ValueError(f"--suffix-max-depth {self.max_depth}: the trees hold a match and a draft, so >= 2")
        if self.spec_factor < 0 or self.spec_offset < 0 or self.spec_factor + self.spec_offset <= 0:
            raise ValueError(f"--suffix-spec-factor {self.spec_factor} / --suffix-spec-offset {self.spec_offset}: both "
                             ">= 0 and not both 0 (no draft would ever be made)")
        if not 0 <= self.min_prob <= 1:
            raise ValueError(f"--suffix-min-prob {self.min_prob}: a probability, in [0, 1]")
        if self.max_cached < 0:
            raise ValueError(f"--suffix-max-cached {self.max_cached}: replies kept, >= 0 (0: no global tree)")


class SuffixCache:
    """The global tree every request's drafter shares: the replies served, ``max_cached`` at most (FIFO), and a REST
    datastore to read besides."""

    def __init__(self, params: SuffixParams, datastore: Datastore | None = None) -> None:
        self.params, self.datastore = params, datastore
        self.index = datastore.index() if datastore is not None else None
        self.tree = SuffixTree(params.max_depth)
        self._held: deque[int] = deque()
        self._next = 0

    def start(self) -> int | None:
        """A new reply's id in the global tree (the oldest evicted to make room); None: no global tree."""
        if not self.params.max_cached:
            return None
        while len(self._held) >= self.params.max_cached:
            self.tree.remove(self._held.popleft())
        seq, self._next = self._next, self._next + 1
        self._held.append(seq)
        self.tree.extend(seq, [])
        return seq

    def drop(self, seq: int) -> None:
        """Take a reply out of the global tree (its request restarted)."""
        if seq in self.tree:
            self.tree.remove(seq)
            self._held.remove(seq)

    def forget(self) -> None:
        """Empty the global tree (an untimed warm-up's replies are not the served traffic the run measures)."""
        self.tree, self._held = SuffixTree(self.params.max_depth), deque()

    def describe(self) -> str:
        return (f"suffix trees depth {self.params.max_depth}, drafts per matched token {self.params.spec_factor:g}"
                + (f" + {self.params.spec_offset:g}" if self.params.spec_offset else "")
                + f", min p {self.params.min_prob:g}, global tree of {self.tree.sequences} replies ({self.tree.tokens} "
                f"tokens)" + (", a REST datastore" if self.datastore is not None else ""))


class SuffixDrafter(Drafter):
    """One request's drafts: the best of its own tree's, the global tree's and the datastore's speculations."""

    capabilities = Capabilities(trees=("dynamic",), batches=True)  # its own trees (no logits to rank); a batch row by row

    def __init__(self, cache: SuffixCache) -> None:
        self.cache, self.params = cache, cache.params
        self.context: list[int] = []
        self.local = SuffixTree(self.params.max_depth)
        self.reply: int | None = None
        self.device = torch.device("cpu")

    def begin(self, prompt_ids: torch.Tensor, states, next_token: int) -> None:
        self.device = prompt_ids.device
        self.context = prompt_ids[0].tolist()
        self.local = SuffixTree(self.params.max_depth)
        self.local.extend(0, self.context)
        if self.reply is not None:  # begun again: the same request restarted (the benchmark primes each turn once),
            self.cache.drop(self.reply)  # so what the earlier start taught the global tree goes
        self.reply = self.cache.start()
        self._extend([next_token])

    def update(self, emitted: list[int], states) -> None:
        self._extend(emitted)

    def finish(self, emitted: list[int], states) -> None:
        self._extend(emitted)  # the reply's last tokens reach the global tree too

    def _extend(self, tokens: list[int]) -> None:
        self.context += tokens
        self.local.extend(0, tokens)
        if self.reply is not None and self.reply in self.cache.tree:  # evicted (or forgotten) while running: no more
            self.cache.tree.extend(self.reply, tokens)

    def best(self, budget: int, topk: int = 1, levels: int | None = None) -> Speculation:
        """The highest-scoring speculation of at most ``budget`` nodes (ties: the request's own tree, then the
        global tree)."""
        p = self.params
        pattern = self.context[-(p.max_depth - 1):]  # a match of the full depth would leave no room for a draft
        shape = dict(spec_factor=p.spec_factor, spec_offset=p.spec_offset, min_prob=p.min_prob, topk=topk, levels=levels)
        best = speculate(self.local, pattern, budget, **shape)
        if self.reply is not None and self.reply in self.cache.tree:
            found = speculate(self.cache.tree, pattern, budget, **shape)
            best = found if found.score > best.score else best
        index = self.cache.index
        if index is not None:
            lo, hi, m = index.store.longest(pattern)  # its longest match only: a short one's range can be most of it
            if m:
                found = from_match(index, (lo, hi, m), m, budget, **shape)
                best = found if found.score > best.score else best
        return best

    def propose(self, k: int) -> torch.Tensor:
        return torch.tensor(self.best(k).tokens, dtype=torch.long)

    def grow_tree(self, spec: DynamicTree, max_depth: int) -> DraftTree:
        found = self.best(spec.total_tokens, spec.topk, min(spec.depth, max_depth))
        depths = found.depths
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=self.device)  # noqa: E731
        return DraftTree(as_tensor(found.tokens), as_tensor(found.parents), as_tensor(depths), max(depths, default=0))
