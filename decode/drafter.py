"""What a drafter is to the loops: the methods they call (``Drafter``, with the optional ones' defaults) and what it
declares it can do (``Capabilities``).

A drafter's capabilities are data, declared on its class, carried by its catalog entry (heads/spec.py, decode/methods.py)
and read before any weight loads: ``headstart bench`` refuses a flag the drafter does not declare by name
(scripts/benchmark.py ``check_args``), and the conformance suite (tests/test_catalog.py) runs every declared capability
of every entry and expects a refusal for every undeclared one. The loops never ask a drafter ``hasattr``: the optional
methods have defaults here that say "not this drafter" in the loop's own terms (no q, no own tree, nothing to learn).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from headstart.decode.tree import DraftTree, DynamicTree, expand_dynamic_tree
from headstart.decode.verify import Sampling
from headstart.models.target import TargetOutput

TREE_KINDS = ("dynamic", "static", "own")
"""``dynamic``: an EAGLE-2 tree of ``--tree-depth/--tree-topk/--tree-total-tokens`` (grown by the drafter's
``grow_tree``); ``static``: a fixed tree of rank paths (``--tree-paths``), which needs ranked candidates; ``own``: a
tree of the drafter's own shape every round, set by its method's flags (Lookahead's window and guesses: its catalog
entry gives the loop an ``OwnTree``), with no ``--tree``."""


@dataclass(frozen=True)
class Capabilities:
    """What one drafter can do. Every field is a promise the conformance suite checks, and its absence a refusal."""

    trees: tuple[str, ...] = ()
    """The tree kinds it drafts (of ``TREE_KINDS``); () = chains only."""
    chains: bool = True
    """It drafts chains of ``--num-speculative-tokens``; False: every round is its own tree (``trees`` holds "own")."""
    batches: bool = False
    """Decodes a batch of sequences (``--batch-size > 1``), by a batch drafter of its own or row by row."""
    sampled: bool = False
    """``propose_sampled`` draws its drafts from a distribution q and returns it (else the loop verifies one-hot q)."""
    compiled: bool = False
    """``--compile`` compiles its draft step (``precompile`` builds the graphs); else only the target compiles."""
    compiled_batch: bool = False
    """With ``--compile`` and ``--batch-size > 1`` its batched draft step compiles too (``precompile_batch``)."""
    confidence: bool = False
    """A chain can stop at a draft it gives a probability under ``--confidence-threshold`` (decode/confidence.py)."""
    self_verify: bool = False
    """Self-speculative: it drafts on the target's own runner (``attach``) and verifies a chain itself (``verify``),
    reusing what drafting computed."""
    reads_aux: bool = False
    """It reads the target's aux hidden states when decoding: the runner captures them."""

    def __post_init__(self) -> None:
        unknown = [k for k in self.trees if k not in TREE_KINDS]
        if unknown:
            raise ValueError(f"unknown tree kind(s) {unknown}; the kinds are {list(TREE_KINDS)}")
        if not self.chains and "own" not in self.trees:
            raise ValueError("a drafter without chains drafts its own trees: trees=('own',)")
        if self.compiled_batch and not (self.compiled and self.batches):
            raise ValueError("compiled_batch needs compiled and batches")


class Drafter:
    """A drafter for one sequence (decode/generate.py) -- and, where its capabilities say ``batches`` with a batch path
    of its own, for a batch (decode/batch_generate.py ``BatchDrafter``). Subclasses declare ``capabilities`` and
    implement ``begin``, ``propose`` and ``update``; trees add ``tree_root``/``tree_expand``/``to_target``
    (decode/tree.py), or a ``grow_tree`` of their own. A drafter whose drafts come one after another, each read by the
    next step, gets its chains (greedy, sampled, the confidence stop) from decode/chain.py ``ChainDrafter``; a one-layer
    draft over its own KV cache, also its cache, trees, compiled graphs and batch rows from decode/layer_drafter.py
    ``LayerDrafter``."""

    capabilities: ClassVar[Capabilities] = Capabilities()
    confidence_threshold: float = 0.0
    """> 0 (drafters declaring ``confidence``): a chain stops after the first draft it gives a lower probability."""

    def begin(self, prompt_ids: torch.Tensor, states: TargetOutput, next_token: int) -> None:
        """A new sequence: the prompt [1, T], the target's states there ([1, T, ...]: aux hidden states,
        final hidden state) and the first generated token."""
        raise NotImplementedError

    def propose(self, k: int) -> torch.Tensor:
        """Up to k draft tokens [k'] continuing the sequence (deterministic: q is one-hot)."""
        raise NotImplementedError

    def update(self, emitted: list[int], states: TargetOutput) -> None:
        """Tokens appended after verification, and the target's states of the positions that produced them
        ([1, len(emitted), ...]: position j's state pairs with emitted token j). The round that ends the request
        gets ``finish`` instead (nothing is drafted after it)."""
        raise NotImplementedError

    def propose_sampled(self, k: int, sampling: Sampling, generator: torch.Generator | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Up to k drafts and the distributions q [k', V] they were drawn from; None: deterministic drafts (one-hot q,
        the loop's rule), which is what a drafter that does not declare ``sampled`` proposes."""
        return self.propose(k), None

    def propose_sampled_batch(self, budgets: list[int], sampling: Sampling, generator: torch.Generator | None = None
                              ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """A batch drafter's ``propose_sampled``: per row its drafts and q (None: one-hot)."""
        return self.propose_batch(budgets), [None] * len(budgets)

    def propose_batch(self, budgets: list[int]) -> list[torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} has no batch path of its own")

    def tree_root(self) -> torch.Tensor:
        """Trees of ranked candidates (decode/tree.py): the root's children logits; a drafter declaring no trees has
        none (the catalog refuses --tree first)."""
        raise NotImplementedError(f"{type(self).__name__} drafts chains only: its capabilities declare no trees")

    def tree_expand(self, parents: torch.Tensor, tokens: torch.Tensor, depth: int) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} drafts chains only: its capabilities declare no trees")

    def grow_tree(self, spec: DynamicTree, max_depth: int) -> DraftTree:
        """The round's dynamic tree: EAGLE-2's expansion of ranked candidates, at most ``max_depth`` levels deep (the
        length budget), through ``dynamic_tree``'s one graph where the drafter has it. A drafter without logits to rank
        (n-gram lookup) grows its own."""
        return expand_dynamic_tree(self, spec, max_depth)

    def dynamic_tree(self, spec: DynamicTree) -> tuple[torch.Tensor, ...] | None:
        """The full-depth tree of ``spec`` as one compiled graph (tokens, parents, levels, mask), or None: none here."""
        return None

    def attach(self, runner) -> None:
        """Self-speculative drafters (``self_verify``): the target's runner they draft on, handed over before
        ``begin``."""
        raise NotImplementedError(f"{type(self).__name__} does not draft on the target's runner")

    def verify(self, block: torch.Tensor):
        """Self-speculative drafters: the target's forward over a chain's block [1, 1 + k'] -> (logits, states),
        reusing what drafting computed (the loop calls it in place of ``runner.forward``)."""
        raise NotImplementedError(f"{type(self).__name__} does not verify its own drafts")

    def observed(self, choices: torch.Tensor) -> None:
        """A tree round, verified: the target's token at every position of the block [1 + n] (the root's first, then
        the nodes', kept or not: its argmax, or its one sample), before ``update``. A drafter whose next drafts come
        from what the target makes of this round's guesses reads it (Lookahead's lookahead branch); the others have
        nothing to do."""

    def finish(self, emitted: list[int], states: TargetOutput) -> None:
        """The request's last round, as far as the output keeps it, and the target's states of the positions that
        produced those tokens (as ``update``'s): a drafter that learns what it serves (n-gram lookup's datastore, an
        online head: trainer/online.py) reads it; the others have nothing to do. The loop times it as ``learn``."""

    def warm_ups(self) -> list[Drafter]:
        """Drafters an untimed warm-up decodes besides this one (a hybrid's model drafting every round, so its graphs
        compile before the timed rounds); none by default."""
        return []
