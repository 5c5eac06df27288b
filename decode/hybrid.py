"""A model drafter and n-gram lookup, one of them a round: SuffixDecoding's hybrid (Oliaro et al. 2024).

Each round n-gram lookup drafts first (decode/ngram.py: over the request's tokens and a datastore of the target's
replies, on the host, well under a millisecond); where the drafts it expects accepted -- the sum of its nodes' path
probabilities under its counts -- reach ``min_score``, they are verified, and the model drafter (a head or a draft
model: milliseconds of forwards) does not run. Elsewhere the model drafts as it would alone. Text the target repeats
(its own phrasing, code, what the prompt holds) then costs no draft forwards; text it does not, the model's tau.

Both drafters read every round's outcome, so either can draft the next one. The model reads the rounds n-gram lookup
drafted only when it next drafts, all of them in one update (``max_flush`` tokens at most a forward: a compiled drafter's
largest precompiled commit): a head's update is a forward of its layer, which n-gram rounds would otherwise pay for
nothing. The round the model drafted it reads at once (a draft model keeps the accepted drafts it already ran). The choice
depends on the tokens so far only, so greedy output stays the target's and sampling stays lossless: n-gram drafts are
deterministic (q one-hot), the model's carry their q.
"""

from __future__ import annotations

import math

import torch

from headstart.decode.drafter import Capabilities, Drafter
from headstart.decode.generate import Sampling
from headstart.decode.ngram import NgramDrafter
from headstart.decode.tree import DraftTree, DynamicTree, build_dynamic_tree
from headstart.models.target import TargetOutput


def ngram_share(rounds: dict[str, int]) -> float:
    """The share of a hybrid's rounds (``HybridDrafter.rounds``, summed over drafters) that n-gram lookup drafted."""
    return rounds["ngram"] / max(1, rounds["ngram"] + rounds["model"])


class HybridDrafter(Drafter):
    def __init__(self, model: Drafter, ngram: NgramDrafter, min_score: float, max_flush: int | None = None,
                 model_tree: DynamicTree | None = None) -> None:
        """``model``: any drafter of decode/generate.py with dynamic trees (decode/tree.py); ``min_score``: the
        n-gram drafts' expected accepted count from which they are used instead of the model's; ``max_flush``: the
        most tokens the model reads in one update (None: any); ``model_tree``: the model's own tree shape in the tree
        rounds it drafts (None: the round's; a head's cheapest good tree is often shallower than n-gram lookup's), of
        at most the round's tokens (the verify block the target's runner holds)."""
        if model.capabilities.self_verify:
            raise ValueError(f"{type(model).__name__} verifies its own drafts on the target's runner: n-gram lookup "
                             "cannot take its rounds")
        if min_score < 0:
            raise ValueError(f"the hybrid's min_score is an expected number of accepted drafts: >= 0, got {min_score}")
        if max_flush is not None and max_flush < 1:
            raise ValueError(f"max_flush must be >= 1 token, got {max_flush}")
        self.model, self.ngram, self.min_score, self.max_flush = model, ngram, min_score, max_flush
        self.model_tree = model_tree
        self.rounds = {"ngram": 0, "model": 0}  # which drafter drafted each round (reported by the benchmark)
        self._pending: list[tuple[list[int], TargetOutput]] = []  # n-gram rounds the model has not read yet
        self._model_drafted = False

    @property
    def capabilities(self) -> Capabilities:
        """The model's, less what a round of n-gram lookup has no part in: static trees rank one model's candidates,
        the batch and the chain's early stop are the model's alone."""
        own = self.model.capabilities
        return Capabilities(trees=("dynamic",) if "dynamic" in own.trees else (), sampled=own.sampled,
                            compiled=own.compiled, reads_aux=own.reads_aux)

    def begin(self, prompt_ids: torch.Tensor, states, next_token: int) -> None:
        self._pending, self._model_drafted = [], False
        self.ngram.begin(prompt_ids, states, next_token)
        self.model.begin(prompt_ids, states, next_token)

    def update(self, emitted: list[int], states: TargetOutput) -> None:
        self.ngram.update(emitted, states)
        if self._model_drafted:
            self.model.update(emitted, states)
        else:  # a copy: a compiled runner's next forward may overwrite the buffers these rows are views of
            self._pending.append((list(emitted), TargetOutput.cat([states])))

    def _flush(self) -> None:
        """The model reads the n-gram rounds it has not: their tokens and states at once, ``max_flush`` at a time."""
        if not self._pending:
            return
        tokens = [t for emitted, _ in self._pending for t in emitted]
        states = TargetOutput.cat([s for _, s in self._pending])
        self._pending = []
        step = self.max_flush or len(tokens)
        for start in range(0, len(tokens), step):
            self.model.update(tokens[start : start + step], states.select(slice(start, start + step)))

    def _choose(self, use_ngram: bool) -> bool:
        """Count the round as n-gram lookup's or the model's (which first reads the rounds it skipped: a round's clock
        counts that late update as draft time)."""
        self.rounds["ngram" if use_ngram else "model"] += 1
        self._model_drafted = not use_ngram
        if not use_ngram:
            self._flush()
        return use_ngram

    def _ngram_chain(self, k: int) -> torch.Tensor | None:
        """n-gram lookup's chain where it expects ``min_score`` accepted drafts, else None (the model's round, the
        model up to date). With nothing to draft (k = 0: a reply's last token) the empty chain, no round counted and no
        late update run: nothing the model would read it for follows."""
        drafts, score = self.ngram.scored_chain(k)
        if k < 1:
            return drafts
        return drafts if self._choose(drafts.numel() > 0 and score >= self.min_score) else None

    def propose(self, k: int) -> torch.Tensor:
        drafts = self._ngram_chain(k)
        return self.model.propose(k) if drafts is None else drafts

    def propose_sampled(self, k: int, sampling: Sampling, generator: torch.Generator | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's sampled drafts and their q, or n-gram lookup's with q None (one-hot: the loop's rule for a
        deterministic proposal)."""
        drafts = self._ngram_chain(k)
        if drafts is not None:
            return drafts, None
        return self.model.propose_sampled(k, sampling, generator)

    def grow_tree(self, spec: DynamicTree, max_depth: int) -> DraftTree:
        """n-gram lookup's tree of ``spec`` where it expects ``min_score`` accepted drafts, else the model's EAGLE-2 tree
        of ``model_tree``'s shape or the same (its compiled graph where it has one)."""
        own = self.model_tree or spec
        if own.total_tokens > spec.total_tokens:
            raise ValueError(f"the model's trees ({own.total_tokens} tokens) must fit the round's verify block of "
                             f"{spec.total_tokens}")
        tree, score = self.ngram.scored_tree(spec, max_depth)
        if max_depth < 1:  # a reply's last token: the empty tree, as for an empty chain
            return tree
        return tree if self._choose(tree.size > 0 and score >= self.min_score) else build_dynamic_tree(self.model, own,
                                                                                                         max_depth)

    def warm_ups(self) -> list[HybridDrafter]:
        """What an untimed warm-up decodes besides this drafter: the same hybrid with the model drafting every round, so
        a compiled model compiles its chain and tree graphs (its own tree shape) before the timed rounds -- where n-gram
        lookup drafts the warm-up's few rounds, the model's first round would otherwise be a timed one."""
        return [HybridDrafter(self.model, self.ngram, math.inf, self.max_flush, self.model_tree)]

    def tree_root(self) -> torch.Tensor:
        raise TypeError("the hybrid grows dynamic trees (--tree); a static tree ranks one model's candidates, which the "
                        "rounds n-gram lookup drafts have none of")

    def finish(self, emitted: list[int], states) -> None:
        """A request's last round (decode/generate.py): n-gram lookup may learn it; the model reads nothing more."""
        self.ngram.finish(emitted, states)
