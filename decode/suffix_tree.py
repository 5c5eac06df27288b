"""SuffixDecoding's trees (Oliaro et al., 2024; Arctic Inference, served by vLLM as ``method: "suffix"``): counts of
every run of at most ``depth`` tokens of the sequences added, as a trie. A node is a token sequence; its count is how
many times that sequence occurred, so a child's count over its parent's is how often the child's token followed.

Sequences grow a token at a time (a reply as it is verified): a token extends the at most ``depth - 1`` suffixes still
open at its sequence's end, so adding one costs ``depth`` steps. A sequence can be removed (the global tree's FIFO
eviction, vLLM's ``suffix_decoding_max_cached_requests``).

``speculate`` is the drafting rule over any such index -- this trie or REST's suffix array (decode/rest.py): for every
length of the context's suffix found, grow the likeliest continuation (a path, or a tree best-first) of at most
``length * spec_factor + spec_offset`` tokens, stopping where a node's probability -- the product of its path's
child-over-parent counts -- falls under ``min_prob``; keep the candidate whose probabilities sum highest (the drafts
it expects accepted).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Protocol


class SuffixIndex(Protocol):
    """What ``speculate`` reads: where a token sequence occurs, how often, and what followed it."""

    def locate(self, pattern: list[int]) -> object | None:
        """The node of ``pattern`` (None: it never occurred)."""

    def total(self, node: object) -> int:
        """How many times the node's sequence occurred."""

    def branches(self, node: object, topk: int) -> list[tuple[int, int, object]]:
        """The ``topk`` commonest tokens after it: (token, count, the child's node), commonest first."""


class SuffixTree:
    """A depth-bounded suffix trie with counts over sequences named by any hashable id."""

    def __init__(self, depth: int) -> None:
        if depth < 2:
            raise ValueError(f"a suffix tree's depth is the longest sequence it counts: >= 2 (a match and a draft), got {depth}")
        self.depth = depth
        self.children: list[dict[int, int]] = [{}]  # node -> {token: child}; node 0 is the empty sequence
        self.counts: list[int] = [0]
        self._open: dict[Hashable, list[int]] = {}  # sequence -> its suffixes shorter than depth, longest first
        self._tokens: dict[Hashable, list[int]] = {}

    @property
    def tokens(self) -> int:
        """Tokens counted (over every sequence still held)."""
        return self.counts[0]

    @property
    def sequences(self) -> int:
        return len(self._tokens)

    def __contains__(self, seq: Hashable) -> bool:
        return seq in self._tokens

    def extend(self, seq: Hashable, tokens: list[int]) -> None:
        """Append ``tokens`` to sequence ``seq`` (a new one if unseen)."""
        held = self._tokens.setdefault(seq, [])
        open_ = self._open.get(seq, [])
        for token in tokens:
            held.append(token)
            grown = [self._child(node, token) for node in open_]
            grown.append(self._child(0, token))
            self.counts[0] += 1
            open_ = grown[-(self.depth - 1):]  # a suffix of depth tokens grows no more
        self._open[seq] = open_

    def remove(self, seq: Hashable) -> None:
        """Uncount sequence ``seq`` (every run of it), dropping the nodes no other sequence holds."""
        tokens = self._tokens.pop(seq)
        self._open.pop(seq, None)
        for start in range(len(tokens)):
            node = 0
            for token in tokens[start: start + self.depth]:
                child = self.children[node][token]
                self.counts[child] -= 1
                if self.counts[child] == 0:  # no run left reaches it: cut it off, and what hangs below it
                    del self.children[node][token]
                    self.children[child] = {}
                    break
                node = child
        self.counts[0] -= len(tokens)

    def _child(self, node: int, token: int) -> int:
        child = self.children[node].get(token)
        if child is None:
            child = self.children[node][token] = len(self.counts)
            self.children.append({})
            self.counts.append(0)
        self.counts[child] += 1
        return child

    # -- SuffixIndex ---------------------------------------------------------------------------------------------------

    def locate(self, pattern: list[int]) -> int | None:
        node = 0
        for token in pattern:
            node = self.children[node].get(token)
            if node is None:
                return None
        return node

    def total(self, node: int) -> int:
        return self.counts[node]

    def branches(self, node: int, topk: int) -> list[tuple[int, int, int]]:
        counts, kids = self.counts, self.children[node]
        if topk == 1:  # a path: the commonest child only (the usual case: chains)
            if not kids:
                return []
            token = max(kids, key=lambda t: (counts[kids[t]], -t))
            return [(token, counts[kids[token]], kids[token])]
        best = heapq.nsmallest(topk, kids.items(), key=lambda item: (-counts[item[1]], item[0]))
        return [(token, counts[child], child) for token, child in best]


@dataclass
class Speculation:
    """Drafts as a tree in topological order (a path: parents -1, 0, 1, ...), each with its estimated probability, and
    the length of the context suffix they continue."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match: int = 0

    @property
    def score(self) -> float:
        """The drafts it expects accepted: a node is accepted with its path's probability."""
        return sum(self.probs)

    @property
    def depths(self) -> list[int]:
        out: list[int] = []
        for parent in self.parents:
            out.append(1 if parent < 0 else out[parent] + 1)
        return out


def speculate(index: SuffixIndex, context: list[int], budget: int, spec_factor: float = 1.0, spec_offset: float = 0.0,
              min_prob: float = 0.1, topk: int = 1, levels: int | None = None) -> Speculation:
    """The best-scoring speculation from ``index`` continuing ``context``: over each suffix length found, from 1 up
    (the first not found ends the search: a longer suffix holds it), ``from_match``'s. Ties go to the longer match."""
    best = Speculation()
    for m in range(1, len(context) + 1):
        node = index.locate(context[len(context) - m:])
        if node is None:
            break
        found = from_match(index, node, m, budget, spec_factor, spec_offset, min_prob, topk, levels)
        if found.tokens and found.score >= best.score:
            best = found
    return best


def from_match(index: SuffixIndex, node: object, m: int, budget: int, spec_factor: float = 1.0,
               spec_offset: float = 0.0, min_prob: float = 0.1, topk: int = 1, levels: int | None = None) -> Speculation:
    """The speculation under ``node``, a match of ``m`` tokens: at most ``min(budget, m * spec_factor + spec_offset)``
    nodes of at most ``topk`` children a node and ``levels`` levels (``grow``)."""
    limit = min(budget, int(m * spec_factor + spec_offset + 1e-6))
    found = grow(index, node, limit, min_prob, topk, levels) if limit > 0 else Speculation()
    found.match = m
    return found


def grow(index: SuffixIndex, node: object, limit: int, min_prob: float, topk: int, levels: int | None) -> Speculation:
    """The likeliest nodes under ``node``, best first, while their probability is at least ``min_prob``: a child is
    never likelier than its parent, so the nodes kept are always a tree in topological order."""
    out = Speculation()
    frontier: list[tuple[float, int, int, int, object]] = []  # (-prob, push order, parent or -1, token, node)
    order = itertools.count()  # ties: the commoner sibling, then the shallower node, first
    depths: list[int] = []

    def push(parent: int, at: object, prob: float) -> None:
        total = index.total(at)
        for token, count, child in index.branches(at, topk):
            heapq.heappush(frontier, (-prob * count / total, next(order), parent, token, child))

    push(-1, node, 1.0)
    while frontier and len(out.tokens) < limit:
        neg, _, parent, token, child = heapq.heappop(frontier)
        if -neg < min_prob:
            break
        out.tokens.append(token)
        out.parents.append(parent)
        out.probs.append(-neg)
        depths.append(1 if parent < 0 else depths[parent] + 1)
        if levels is None or depths[-1] < levels:
            push(len(out.tokens) - 1, child, -neg)
    return out
