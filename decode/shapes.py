"""A run's draft shape from its flags: the tree a round drafts (none for a chain), the largest block a compiled
drafter runs after a prompt, and the blocks the target's runner compiles before the first timed turn."""

from __future__ import annotations

import json
from pathlib import Path

from headstart.decode.target_runner import TargetRunner
from headstart.decode.tree import DynamicTree, StaticTree


def draft_tree(paths_file: str | None, dynamic: bool, depth: int, topk: int,
               total_tokens: int) -> DynamicTree | StaticTree | None:
    """A static tree from a JSON file of rank paths (``[[0], [1], [0, 0]]``), else an EAGLE-2 dynamic tree when asked
    for, else None (chains)."""
    if paths_file:
        return StaticTree(tuple(tuple(path) for path in json.loads(Path(paths_file).read_text())))
    return DynamicTree(depth, topk, total_tokens) if dynamic else None


def compiled_block(k: int, tree: DynamicTree | StaticTree | None, model_tree: DynamicTree | None = None) -> int:
    """The largest block a compiled drafter runs after a prompt: a commit of k + 1 tokens (a tree's: depth + 1), a
    tree's widest level (a dynamic tree's top-k nodes, a static tree's paths of one length)."""
    block = k + 1
    for spec in (tree, model_tree):
        if isinstance(spec, DynamicTree):
            block = max(block, spec.depth + 1, spec.topk)
    if isinstance(tree, StaticTree):
        lengths = [len(path) for path in tree.paths]
        block = max(block, max(lengths) + 1, max(lengths.count(n) for n in set(lengths)))
    return block


def precompile_runner(runner: TargetRunner, k: int, tree: DynamicTree | StaticTree | None) -> None:
    """The target's blocks at one sequence: plain decoding's one token and a round's verify block (a chain's k + 1
    tokens; a tree's root and nodes, a masked block). Shorter blocks (a short n-gram match, the last rounds) run padded
    to the verify block's graph. A batch's runner compiles each batch size as the batched loop meets it."""
    if tree is None:
        runner.precompile([1, k + 1])
    else:
        runner.precompile([1], masked=[1 + (tree.total_tokens if isinstance(tree, DynamicTree) else len(tree.paths))],
                          keeps=True)
