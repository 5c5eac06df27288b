"""Lookahead decoding (Fu et al., "Break the Sequential Dependency of LLM Inference Using Lookahead Decoding", ICML
2024): no draft model and no training; the target, in the forward that verifies, also runs Jacobi iterations ahead of
the text and keeps the n-grams they produce for later rounds.

A round is one tree (its shape from ``LookaheadParams``), which the target verifies in one forward:

* the **lookahead branch**, a window of guesses W columns wide and N - 1 levels deep. Level 0 is a chain of W - 1
  guesses after the root (the last emitted token); column c's upper levels hang below level 0's c-th guess (the root
  for c = 0), one guess a level, so each guess sits at the position its column and level give it and sees the
  guesses before it as context -- the paper's attention mask, as tree ancestry. The target's token at the top of a
  column (its argmax, or its sample) is the column's next guess; the column read upwards plus that token is an n-gram
  of N tokens, which goes into the pool. Then the window moves a position on: each level takes the one above it, the
  top level the target's new tokens (the first N - 2 rounds fill the levels, from tokens of the prompt).
* the **verification branch**: the pool's n-grams (at most G) that start with the root, their N - 1 tokens as
  drafts.

Both branches go into one trie (an equal prefix is one node: the same tokens at the same positions see the same
context), so a guess of the lookahead branch that the target agrees with is accepted like a drafted n-gram. Greedy
output is the target's own; under sampling, one sample of the warped target per node keeps it exact
(decode/tree.py ``verify_tree``, deterministic children).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass

import torch

from headstart.decode.drafter import Capabilities, Drafter
from headstart.decode.tree import DraftTree, DynamicTree, OwnTree, Trie


@dataclass(frozen=True)
class LookaheadParams:
    """The reference implementation's LEVEL (``ngram`` = N), WINDOW_SIZE (``window`` = W) and GUESS_SET_SIZE
    (``guesses`` = G), and its defaults; ``from_context``: the pool also holds the request's own n-grams (the prompt's,
    then the reply's as it is verified), as its POOL_FROM_PROMPT does for the prompt."""

    window: int = 7
    ngram: int = 5
    guesses: int = 7
    from_context: bool = False

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"--lookahead-window {self.window}: the window needs at least one column")
        if self.ngram < 2:
            raise ValueError(f"--lookahead-ngram {self.ngram}: an n-gram is a token and its drafts, so at least 2")
        if self.guesses < 0:
            raise ValueError(f"--lookahead-guesses {self.guesses}: n-grams verified a round, 0 or more")
        if self.nodes == 0:
            raise ValueError(f"--lookahead-window {self.window} --lookahead-ngram {self.ngram} --lookahead-guesses 0 "
                             "drafts nothing (no window above the last token and no guesses)")

    @property
    def depth(self) -> int:
        """The deepest node of a round: the window's last column's top, or a guess's last token."""
        return max(self.window + self.ngram - 3, self.ngram - 1)

    @property
    def nodes(self) -> int:
        """The most nodes a round drafts: the window's largest while its levels fill (f levels: a level-0 chain of
        W + N - 2 - f guesses and f - 1 levels over its columns), and G guesses of N - 1 tokens."""
        w, n = self.window, self.ngram
        window = max((w + n - 2 - f) + (f - 1) * (w + n - 1 - f) for f in range(1, n))
        return window + self.guesses * (n - 1)

    def tree(self) -> OwnTree:
        return OwnTree(depth=self.depth, topk=max(1, self.guesses), total_tokens=max(1, self.nodes),
                       about=f"lookahead window {self.window} n-grams of {self.ngram} {self.guesses} guesses"
                             + (" pool from context" if self.from_context else ""))


class LookaheadDrafter(Drafter):
    """One request's window and n-gram pool (a new request starts both afresh)."""

    # Its own tree every round (both branches in the verifying forward); one sequence; deterministic drafts.
    capabilities = Capabilities(trees=("own",), chains=False)

    def __init__(self, params: LookaheadParams, seed: int = 0) -> None:
        self.params = params
        self.rng = random.Random(seed)  # the window's first guesses: tokens of the prompt, as the reference draws them
        self.levels: list[list[int]] = []
        self.pool: dict[int, OrderedDict[tuple[int, ...], None]] = {}
        self.context: list[int] = []
        self.learned = 0  # the context's n-grams from here on are not yet in the pool (from_context)
        self.device = torch.device("cpu")
        self.tops: list[int] | None = None  # this round: each column's top node, None where the window was not drafted
        self.root = 0

    def begin(self, prompt_ids: torch.Tensor, states, next_token: int) -> None:
        w, n = self.params.window, self.params.ngram
        prompt = prompt_ids[0].tolist()
        self.device = prompt_ids.device
        self.context, self.pool, self.learned, self.tops = prompt + [next_token], {}, 0, None
        # level 0 is one guess longer for each level still to fill: each filling round moves every level a position on
        self.levels = [[self.rng.choice(prompt) for _ in range(w + n - 3)]]
        if self.params.from_context:
            self._learn_context()

    def propose(self, k: int) -> torch.Tensor:
        raise NotImplementedError("Lookahead drafts a tree of its own every round (its catalog entry's OwnTree)")

    def grow_tree(self, spec: DynamicTree, max_depth: int) -> DraftTree:
        """The round's trie: the window (where it fits in ``max_depth``, the length budget) and the root's guesses."""
        trie, self.root, self.tops = Trie(), self.context[-1], None
        if len(self.levels[0]) + len(self.levels) - 1 <= max_depth:
            spine = [-1]  # level 0's chain below the root; column c hangs below spine[c]
            for token in self.levels[0]:
                spine.append(trie.child(spine[-1], token))
            self.tops = []
            for c, node in enumerate(spine):
                for level in self.levels[1:]:
                    node = trie.child(node, level[c])
                self.tops.append(node)
        for guess in reversed(self.pool.get(self.root, {})):  # the newest first
            trie.add(guess[:max_depth])
        return trie.tree(self.device)

    def observed(self, choices: torch.Tensor) -> None:
        """The target's tokens at the columns' tops: the window's next level, and (levels full) N-grams for the pool."""
        if self.tops is None:  # the length budget left the window out: it waits
            return
        got = choices.tolist()
        new = [got[top + 1] for top in self.tops]  # block position = node + 1 (the root's is 0)
        if len(self.levels) == self.params.ngram - 1:  # full: each column is an n-gram
            starts = [self.root] + self.levels[0]
            for c, token in enumerate(new):
                self._remember([starts[c], *(level[c] for level in self.levels[1:]), token])
            stack = self.levels[1:] + [new]
            self.levels = [stack[0][1:]] + stack[1:]
        else:  # filling: a level more, and every level a position on (the root moved)
            self.levels = [level[1:] for level in self.levels + [new]]

    def update(self, emitted: list[int], states) -> None:
        self.context += emitted
        if self.params.from_context:
            self._learn_context()

    def _remember(self, ngram: list[int]) -> None:
        """An n-gram into the pool: the G newest per first token (a repeated one becomes the newest)."""
        if self.params.guesses == 0:
            return
        kept = self.pool.setdefault(ngram[0], OrderedDict())
        rest = tuple(ngram[1:])
        kept.pop(rest, None)
        kept[rest] = None
        if len(kept) > self.params.guesses:
            kept.popitem(last=False)

    def _learn_context(self) -> None:
        n = self.params.ngram
        for start in range(self.learned, len(self.context) - n + 1):
            self._remember(self.context[start:start + n])
        self.learned = max(self.learned, len(self.context) - n + 1)
