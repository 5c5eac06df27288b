"""A datastore of what the target says: n-gram counts over the assistant turns of conversations (its own replies, as
regenerated for training a head), which n-gram lookup consults where the request's own tokens match a shorter suffix
or none -- the
global tree of SuffixDecoding (Oliaro et al. 2024) and the datastore of REST (He et al. 2023), as n-gram counts.

Only tokens the assistant says are counted as followers (the chat template's and the user's are context only), so a
lookup proposes what the target would say next, not what a user might type."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch

# An n-gram's key: two polynomial hashes mod 2^31 - 1 side by side, 62 bits (exact in int64 arithmetic: a hash times a
# base stays below 2^62). Distinct n-grams collide with probability ~ keys^2 / 2^62: ~1e-7 for a million of them.
_MOD = 2**31 - 1
_BASES = (1_000_003, 2_147_480_009)


def ngram_key(tokens: Iterable[int]) -> int:
    """The key under which the store files an n-gram (``window_keys`` computes the same for every window at once)."""
    h1 = h2 = 0
    for t in tokens:
        h1 = (h1 * _BASES[0] + t + 1) % _MOD
        h2 = (h2 * _BASES[1] + t + 1) % _MOD
    return (h1 << 31) | h2


def window_keys(ids: torch.Tensor, n: int) -> torch.Tensor:
    """``ngram_key`` of every n-token window of ``ids`` [L] -> [L - n + 1], vectorised."""
    count = ids.numel() - n + 1
    h1 = torch.zeros(count, dtype=torch.long)
    h2 = torch.zeros(count, dtype=torch.long)
    for i in range(n):
        t = ids[i : i + count] + 1
        h1 = (h1 * _BASES[0] + t) % _MOD
        h2 = (h2 * _BASES[1] + t) % _MOD
    return (h1 << 31) | h2


# n-gram -> {next token: [times seen, last position seen]}
Follows = dict[tuple[int, ...], dict[int, list[int]]]


def count_follows(follows: Follows, ids: list[int], start: int, min_ngram: int, max_ngram: int) -> None:
    """Count, in ``follows``, every n-gram (``min_ngram <= n <= max_ngram``) of ``ids`` followed by a token at
    position ``start`` or later."""
    for j in range(max(start, 1), len(ids)):  # ids[j] follows the n-grams ending at j - 1
        for n in range(min_ngram, min(max_ngram, j) + 1):
            seen = follows[tuple(ids[j - n : j])].setdefault(ids[j], [0, 0])
            seen[0] += 1
            seen[1] = j


class NgramStore:
    """n-gram counts over a corpus, for ``NgramDrafter(store=...)``, held as sorted arrays (24 bytes per distinct
    (n-gram, next token) pair for each n, where dicts of tuples cost ~30x that): a lookup is a binary search. Suffixes
    shorter than ``min_ngram`` are not looked up here: one token of context says little about what a reply says next,
    the request's own context says more."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes: need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens = 0  # followers counted
        self._sequences: list[tuple[torch.Tensor, torch.Tensor]] = []  # (ids, counted-follower mask)
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
        # What ``learn`` counted since, as n-gram lookup counts a request: beside the tables, so that learning a reply
        # costs its own n-grams, not a rebuild
        self._learned: Follows = defaultdict(dict)
        self.learned_tokens = 0

    def add(self, ids: list[int], followers: list[int] | None = None) -> None:
        """Count a token sequence; with ``followers`` (0/1 per token) only what follows into masked tokens."""
        mask = torch.ones(len(ids), dtype=torch.bool) if followers is None else torch.tensor(followers, dtype=torch.bool)
        mask[:1] = False  # the first token follows nothing
        self._sequences.append((torch.tensor(ids, dtype=torch.long), mask))
        self.tokens += int(mask.sum())
        self._tables = None  # rebuilt at the next lookup

    def learn(self, ids: list[int], start: int) -> None:
        """Count what follows into ``ids[start:]`` (tokens the target just generated, ``ids[:start]`` their context) at
        once, without rebuilding the tables: SuffixDecoding's global tree growing with every response it serves."""
        first = max(start, self.min_ngram)
        count_follows(self._learned, ids, first, self.min_ngram, self.max_ngram)
        self.learned_tokens += max(len(ids) - first, 0)

    def forget(self) -> None:
        """Drop what ``learn`` counted (the tables stay): a replay of several shapes starts each from the same store."""
        self._learned, self.learned_tokens = defaultdict(dict), 0

    @property
    def ngrams(self) -> int:
        """Distinct n-grams counted (every n)."""
        return sum(int(torch.unique_consecutive(keys).numel()) for keys, _, _ in self._built().values())

    def lookup(self, key: tuple[int, ...], topk: int) -> list[tuple[int, float]] | None:
        """The ``topk`` most frequent tokens after the n-gram ``key`` with their share of its counts (ties: the smaller
        token id first); None when it was never seen or its length is not looked up here."""
        if not self.min_ngram <= len(key) <= self.max_ngram:
            return None
        keys, tokens, counts = self._built()[len(key)]
        h = torch.tensor([ngram_key(key)])
        lo, hi = int(torch.searchsorted(keys, h)), int(torch.searchsorted(keys, h, right=True))
        learned = self._learned.get(tuple(key))
        if learned:  # the tables' counts and the learned ones together
            merged = dict(zip(tokens[lo:hi].tolist(), counts[lo:hi].tolist()))
            for token, (count, _) in learned.items():
                merged[token] = merged.get(token, 0) + count
            total = sum(merged.values())
            return [(t, c / total) for t, c in sorted(merged.items(), key=lambda tc: (-tc[1], tc[0]))[:topk]]
        if lo == hi:
            return None
        total = int(counts[lo:hi].sum())
        return [(int(t), int(c) / total) for t, c in zip(tokens[lo : min(hi, lo + topk)], counts[lo : min(hi, lo + topk)])]

    def _built(self) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per n: the distinct (key, next token) pairs sorted by key, then by count (descending), then token; and the
        counts."""
        if self._tables is None:
            self._tables = {}
            for n in range(self.min_ngram, self.max_ngram + 1):
                keys, nexts = [], []
                for ids, mask in self._sequences:
                    if ids.numel() > n:
                        counted = mask[n:]  # window s is followed by ids[s + n]
                        keys.append(window_keys(ids[:-1], n)[counted])
                        nexts.append(ids[n:][counted])
                pairs = torch.stack([torch.cat(keys), torch.cat(nexts)], 1) if keys else torch.zeros(0, 2, dtype=torch.long)
                order = torch.argsort(pairs[:, 1], stable=True)
                pairs = pairs[order[torch.argsort(pairs[order, 0], stable=True)]]
                pairs, counts = torch.unique_consecutive(pairs, dim=0, return_counts=True)
                order = torch.argsort(-counts, stable=True)
                order = order[torch.argsort(pairs[order, 0], stable=True)]
                self._tables[n] = (pairs[order, 0].contiguous(), pairs[order, 1].contiguous(), counts[order])
        return self._tables
