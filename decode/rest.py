"""REST, retrieval-based speculative decoding (He et al., NAACL 2024): drafts from a datastore of token sequences.

The datastore is a suffix array over the token ids of a corpus (``headstart datastore`` builds one from a recipe's
conversations, rendered as the trainer renders them). Each round the longest suffix of the context (up to
``max_match`` tokens) found in it selects every place it occurred; what followed there, counted, is a trie of
continuations whose likeliest nodes are drafted as a tree (or its likeliest branch as a chain), verified by the target
as usual -- lossless, no model, no training.

A node's matches are its parent's narrowed by one token (the suffix array keeps suffixes sharing a prefix together,
sorted by the token after it), so growing a tree costs a binary search a node, not a new lookup.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from headstart.decode.drafter import Capabilities
from headstart.decode.ngram import CountTree

SEPARATOR = -1
"""Between the corpus's sequences: no match crosses it, no continuation runs past it."""
FILES = ("tokens.npy", "suffix_array.npy", "datastore.json")


def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """The start positions of ``tokens``' suffixes in lexicographic order (a suffix that ends sorts before every longer
    one sharing its tokens; separators sort before every token), by prefix doubling: O(n log^2 n) in numpy."""
    n = len(tokens)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    rank = tokens.astype(np.int64) + 2  # separator -> 1, tokens -> >= 2; 0 is "past the end"
    width = 1
    while True:
        second = np.zeros(n, dtype=np.int64)
        second[: n - width] = rank[width:] if width < n else second[:0]
        order = np.lexsort((second, rank))
        r1, r2 = rank[order], second[order]
        new_group = np.ones(n, dtype=bool)
        new_group[1:] = (r1[1:] != r1[:-1]) | (r2[1:] != r2[:-1])
        ranks = np.cumsum(new_group)
        rank = np.empty(n, dtype=np.int64)
        rank[order] = ranks
        if ranks[-1] == n or width >= n:  # every suffix told apart
            return order.astype(np.int64)
        width *= 2


@dataclass
class Datastore:
    """A corpus's token ids (sequences joined by ``SEPARATOR``) and their suffix array, with what built it."""

    tokens: np.ndarray  # int32 [n]
    order: np.ndarray  # int64 [n]: the suffix array
    meta: dict

    @classmethod
    def build(cls, sequences: list[list[int]], meta: dict | None = None) -> Datastore:
        """Join ``sequences`` and sort their suffixes; ``meta`` (the tokenizer, the sources) is kept with it."""
        start = time.perf_counter()
        joined = [t for seq in sequences for t in (*seq, SEPARATOR)]
        tokens = np.asarray(joined, dtype=np.int32)
        order = suffix_array(tokens)
        seconds = time.perf_counter() - start
        return cls(tokens, order, {**(meta or {}), "sequences": len(sequences), "tokens": int(len(tokens) - len(sequences)),
                                   "build_seconds": round(seconds, 3), "bytes": int(tokens.nbytes + order.nbytes)})

    def save(self, directory: str | Path) -> None:
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        np.save(out / "tokens.npy", self.tokens)
        np.save(out / "suffix_array.npy", self.order)
        (out / "datastore.json").write_text(json.dumps(self.meta, indent=1) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> Datastore:
        """A saved datastore, refused by name where a file is missing or the two arrays do not belong together."""
        d = Path(directory)
        missing = [f for f in FILES if not (d / f).is_file()]
        if missing:
            raise FileNotFoundError(f"{d}: not a REST datastore (missing {', '.join(missing)}); build one with "
                                    "`headstart datastore --config RECIPE --output DIR`")
        tokens, order = np.load(d / "tokens.npy"), np.load(d / "suffix_array.npy")
        if tokens.shape != order.shape or tokens.ndim != 1:
            raise ValueError(f"{d}: tokens.npy {tokens.shape} and suffix_array.npy {order.shape} do not match; rebuild it")
        if not len(tokens) or int((tokens != SEPARATOR).sum()) == 0:
            raise ValueError(f"{d}: the datastore is empty; build it from conversations with assistant turns")
        return cls(tokens, order, json.loads((d / "datastore.json").read_text()))

    # -- lookups ------------------------------------------------------------------------------------------------------

    def _at(self, i: int, offset: int) -> int:
        """The token ``offset`` after the start of suffix number ``i``; -2 past the end (sorts first)."""
        p = int(self.order[i]) + offset
        return int(self.tokens[p]) if p < len(self.tokens) else -2

    def narrow(self, lo: int, hi: int, offset: int, token: int) -> tuple[int, int]:
        """Within ``[lo, hi)`` (suffixes sharing their first ``offset`` tokens, so sorted by the next one), those whose
        token at ``offset`` is ``token``."""
        a, b = lo, hi
        while a < b:  # first with token >= ``token``
            mid = (a + b) // 2
            if self._at(mid, offset) < token:
                a = mid + 1
            else:
                b = mid
        first, b = a, hi
        while a < b:  # first with token > ``token``
            mid = (a + b) // 2
            if self._at(mid, offset) <= token:
                a = mid + 1
            else:
                b = mid
        return first, a

    def find(self, pattern: list[int]) -> tuple[int, int]:
        """The suffixes beginning with ``pattern``: ``[lo, hi)`` of the suffix array (empty: lo == hi)."""
        lo, hi = 0, len(self.order)
        for offset, token in enumerate(pattern):
            lo, hi = self.narrow(lo, hi, offset, token)
            if lo == hi:
                break
        return lo, hi

    def followers(self, lo: int, hi: int, offset: int, topk: int, step: int = 1) -> list[tuple[int, float]]:
        """The ``topk`` tokens found ``offset`` after the starts of suffixes ``[lo, hi)`` (every ``step``-th) with their
        share of the counts (a separator -- the sequence ended -- counts toward none); ties: the smaller id first."""
        positions = self.order[lo:hi:step] + offset
        found = self.tokens[positions[positions < len(self.tokens)]]
        found = found[found != SEPARATOR]
        if not len(found):
            return []
        values, counts = np.unique(found, return_counts=True)  # by token id, so a stable sort by count ranks ties by id
        best = np.argsort(-counts, kind="stable")[:topk]
        return [(int(values[i]), float(counts[i]) / len(found)) for i in best]

    def longest(self, tail: list[int]) -> tuple[int, int, int]:
        """The longest suffix of ``tail`` found: its range and length ((0, 0, 0): none). A suffix found means every
        shorter one is too, so the length is bisected: a few lookups, not one per length."""
        best, a, b = (0, 0, 0), 1, len(tail)
        while a <= b:
            n = (a + b) // 2
            lo, hi = self.find(tail[-n:])
            if lo < hi:
                best, a = (lo, hi, n), n + 1
            else:
                b = n - 1
        return best

    def index(self) -> DatastoreIndex:
        """This datastore as suffix decoding reads a suffix tree (decode/suffix_tree.py)."""
        return DatastoreIndex(self)


class DatastoreIndex:
    """A ``SuffixIndex`` over a datastore: a node is a range of the suffix array and the length its suffixes share, so
    a node's count is the range's size and a child's range is its parent's narrowed by one token. A range of more than
    ``sample`` suffixes picks its commonest next tokens at ``sample`` evenly spaced suffixes (they are sorted by that
    token, so each token's share is right to 1/``sample``); their counts are then exact."""

    def __init__(self, store: Datastore, sample: int = 4096) -> None:
        self.store, self.sample = store, sample

    def locate(self, pattern: list[int]) -> tuple[int, int, int] | None:
        lo, hi = self.store.find(pattern)
        return (lo, hi, len(pattern)) if lo < hi else None

    def total(self, node: tuple[int, int, int]) -> int:
        return node[1] - node[0]

    def branches(self, node: tuple[int, int, int], topk: int) -> list[tuple[int, int, tuple[int, int, int]]]:
        lo, hi, n = node
        step = max(1, (hi - lo) // self.sample)
        found = [(token, *self.store.narrow(lo, hi, n, token)) for token, _ in
                 self.store.followers(lo, hi, n, topk, step=step)]
        return sorted(((token, b - a, (a, b, n + 1)) for token, a, b in found), key=lambda x: (-x[1], x[0]))


def vocab_fingerprint(tokenizer) -> str:
    """The tokenizer's vocabulary, hashed: a datastore's token ids mean something only under the same one."""
    return hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()[:16]


class RestDrafter(CountTree):
    """REST's drafts: the continuations, in ``store``, of the context's longest suffix found there (at most
    ``max_match`` tokens); a tree's node continues its parent's matches narrowed by its own token."""

    capabilities = Capabilities(trees=("dynamic",), batches=True)  # a batch row by row (PerSequence)

    def __init__(self, store: Datastore, max_match: int = 16) -> None:
        if max_match < 1:
            raise ValueError(f"max_match is the longest context suffix looked up: >= 1, got {max_match}")
        self.store, self.max_match = store, max_match
        self.context: list[int] = []
        self.device = torch.device("cpu")
        self._matches: dict[tuple[int, ...], tuple[int, int, int]] = {}  # path -> (lo, hi, matched length)

    def begin(self, prompt_ids: torch.Tensor, states, next_token: int) -> None:
        self.device = prompt_ids.device
        self.context = prompt_ids[0].tolist() + [next_token]
        self._matches = {}

    def update(self, emitted: list[int], states) -> None:
        self.context += emitted
        self._matches = {}

    def propose(self, k: int) -> torch.Tensor:
        return self.scored_chain(k)[0]

    def _root(self) -> tuple[int, int, int]:
        return self.store.longest(self.context[-self.max_match:])

    def _match(self, path: tuple[int, ...]) -> tuple[int, int, int]:
        """The matches of context + ``path``: the parent's narrowed by the last token (a fresh lookup of the last
        ``max_match`` tokens where that would outgrow it, or where the narrowed range is empty)."""
        if path in self._matches:
            return self._matches[path]
        if not path:
            found = self._root()
        else:
            lo, hi, n = self._match(path[:-1])
            lo, hi = self.store.narrow(lo, hi, n, path[-1]) if n < self.max_match and lo < hi else (0, 0)
            if lo < hi:
                found = (lo, hi, n + 1)
            else:
                found = self.store.longest((self.context + list(path))[-self.max_match:])
        self._matches[path] = found
        return found

    def children(self, path: tuple[int, ...], topk: int) -> list[tuple[int, float]]:
        lo, hi, n = self._match(path)
        return self.store.followers(lo, hi, n, topk) if n else []
