"""A datastore of what the target says: n-gram counts over the assistant turns of conversations (its own replies, as
regenerated for training a head), which n-gram lookup consults where the request's own tokens have no match -- the
global tree of SuffixDecoding (Oliaro et al. 2024) and the datastore of REST (He et al. 2023), as n-gram counts.

Only tokens the assistant says are counted as followers (the chat template's and the user's are context only), so a
lookup proposes what the target would say next, not what a user might type."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from transformers import PreTrainedTokenizerBase

# n-gram -> {next token: [times seen, last position seen]}
Follows = dict[tuple[int, ...], dict[int, list[int]]]


def count_follows(follows: Follows, ids: list[int], start: int, min_ngram: int, max_ngram: int,
                  followers: list[int] | None = None) -> None:
    """Count, in ``follows``, every n-gram (``min_ngram <= n <= max_ngram``) of ``ids`` followed by a token at
    position ``start`` or later; with ``followers`` (a 0/1 mask over ``ids``) only those followed by a masked token."""
    for j in range(max(start, 1), len(ids)):  # ids[j] follows the n-grams ending at j - 1
        if followers is not None and not followers[j]:
            continue
        for n in range(min_ngram, min(max_ngram, j) + 1):
            seen = follows[tuple(ids[j - n : j])].setdefault(ids[j], [0, 0])
            seen[0] += 1
            seen[1] = j


def likeliest(follow: dict[int, list[int]], topk: int) -> list[tuple[int, float]]:
    """The ``topk`` most frequent followers with their share of the counts (ties: the most recently seen first)."""
    total = sum(seen[0] for seen in follow.values())
    best = sorted(follow.items(), key=lambda item: (-item[1][0], -item[1][1]))[:topk]
    return [(token, seen[0] / total) for token, seen in best]


class NgramStore:
    """n-gram counts over a corpus, for ``NgramDrafter(store=...)``. Suffixes shorter than ``min_ngram`` are not looked
    up here: one token of context says little about what a reply says next, the request's own context says more."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes: need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.follows: Follows = defaultdict(dict)
        self.tokens = 0  # followers counted

    def add(self, ids: list[int], followers: list[int] | None = None) -> None:
        """Count a token sequence; with ``followers`` (0/1 per token) only what follows into masked tokens."""
        count_follows(self.follows, ids, 1, self.min_ngram, self.max_ngram, followers)
        self.tokens += sum(followers[1:]) if followers is not None else max(len(ids) - 1, 0)

    @classmethod
    def from_conversations(cls, paths: Iterable[str], tokenizer: PreTrainedTokenizerBase, max_ngram: int = 4,
                           min_ngram: int = 2) -> NgramStore:
        """Count the assistant turns of conversation files (any format the trainer reads, ``file[a:b]`` row ranges
        included), rendered with the tokenizer's chat template as the target sees them. A file with no usable
        conversation is an error that names it; single bad rows are skipped."""
        from headstart.trainer.chat import tokenize_conversation
        from headstart.trainer.conversations import RowError, detect_format, to_messages
        from headstart.trainer.data import read_rows

        store = cls(max_ngram, min_ngram)
        for path in paths:
            rows, used = read_rows(path), 0
            fmt = detect_format(rows[0]) if len(rows) else None
            if fmt == "text":
                raise ValueError(f"{path}: an n-gram store reads conversations (whose assistant turns it counts), "
                                 "not 'text' rows")
            for row in rows:
                try:
                    tok = tokenize_conversation(tokenizer, to_messages(row, fmt))
                except RowError:
                    continue
                store.add(tok.input_ids, tok.loss_mask)
                used += 1
            if not used:
                raise ValueError(f"{path}: no conversation with an assistant turn to count")
        return store
