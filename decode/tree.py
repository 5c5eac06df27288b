"""Draft trees: EAGLE-2 dynamic trees, static (Medusa-style) trees, and their verification.

A tree hangs below the *root*, the last emitted token. The target scores ``[root, nodes...]`` in one
forward with an ancestor mask (a node sees the committed context, its ancestors and itself) and
position id = context length + depth. Node order is topological (a parent before its children).

Drafters that build trees expose three calls, all without host syncs:
  ``tree_root() -> logits [V_d]``: the distribution of the root's children;
  ``tree_expand(parents [m], tokens [m], depth) -> logits [m, V_d]``: run m new nodes (draft-vocab
  ``tokens`` at ``depth``) whose parents are earlier *expanded* nodes (index in call order, -1 =
  the root) and return the distributions of their children;
  ``to_target(ids) -> ids``: map draft-vocab ids to target ids.
and ``dynamic_tree(spec)``: the full-depth tree as one compiled graph, or None (decode/drafter.py's default).
A drafter without a model (n-gram lookup: decode/ngram.py) has no logits to expand; it grows a dynamic tree's
nodes itself instead: its ``grow_tree(spec, max_depth) -> DraftTree``.
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass
from typing import Callable, Protocol

import torch


class TreeDrafter(Protocol):
    def dynamic_tree(self, spec: DynamicTree) -> tuple[torch.Tensor, ...] | None: ...

    def tree_root(self) -> torch.Tensor: ...

    def tree_expand(self, parents: torch.Tensor, tokens: torch.Tensor, depth: int) -> torch.Tensor: ...

    def to_target(self, ids: torch.Tensor) -> torch.Tensor: ...


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [n] target ids
    parents: torch.Tensor  # [n] index of the parent node, -1 = the root
    depths: torch.Tensor  # [n] 1 for the root's children
    max_depth: int

    @property
    def size(self) -> int:
        return self.tokens.numel()

    def block_depths(self) -> torch.Tensor:
        """[1+n] position offsets of [root, nodes...]."""
        return torch.cat([self.depths.new_zeros(1), self.depths])

    @functools.cached_property
    def block_mask(self) -> torch.Tensor:
        """[1+n, 1+n] bool: row i may attend to its ancestors (root included) and itself (computed once:
        the target's forward and the verification both use it; a compiled tree sets it with its nodes)."""
        return ancestor_mask(self.parents, self.max_depth)


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[1+n, 1+n] bool for the block [root, nodes...] of a tree whose nodes have these ``parents`` [n] (-1 = the
    root): row i may attend to its ancestors (root included) and itself."""
    n, device = parents.numel(), parents.device
    parent = torch.cat([torch.zeros(1, dtype=torch.long, device=device), parents + 1])  # root -> itself
    step = torch.zeros(n + 1, n + 1, device=device)
    step[torch.arange(1, n + 1, device=device), parent[1:]] = 1.0
    eye = torch.eye(n + 1, device=device)
    mask = eye.clone()
    for _ in range(max_depth):  # after d rounds every node sees its ancestors up to d levels up
        mask = ((eye + step @ mask) > 0).float()
    return mask.bool()


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2: grow ``depth`` levels, expanding the ``topk`` best nodes of each level (cumulative
    draft log-probability) into their ``topk`` children; keep the best ``total_tokens`` nodes."""

    depth: int = 6
    topk: int = 8
    total_tokens: int = 48

    def __post_init__(self) -> None:
        if min(self.depth, self.topk, self.total_tokens) < 1:
            raise ValueError(f"tree depth, topk and total_tokens must be >= 1, got {self}")


@dataclass(frozen=True)
class OwnTree(DynamicTree):
    """The tree a drafter grows every round in a shape of its own (``Capabilities.trees`` "own": Lookahead's window and
    guesses), which its method's flags set: ``depth`` and ``total_tokens`` bound its nodes' depth and count (the
    acceptance table's positions, the compiled verify block), ``about`` names the shape in tables."""

    about: str = ""


@dataclass(frozen=True)
class StaticTree:
    """Medusa-style: a fixed list of paths of per-level ranks ([0, 1] = top-1 then its top-2)."""

    paths: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        known = set(self.paths)
        for p in self.paths:
            if not p or min(p) < 0:
                raise ValueError(f"static tree path {list(p)}: ranks must be >= 0 and the path non-empty")
            if len(p) > 1 and p[:-1] not in known:
                raise ValueError(f"static tree path {list(p)} has no parent path {list(p[:-1])}; list every prefix")
        if len(known) != len(self.paths):
            raise ValueError("static tree paths repeat")


def _empty(device: torch.device) -> DraftTree:
    z = torch.empty(0, dtype=torch.long, device=device)
    return DraftTree(z, z.clone(), z.clone(), 0)


def root_level(root_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A dynamic tree's first level: the root's top-k children (draft ids [k]) and their log-probabilities [k]."""
    top = torch.log_softmax(root_logits.float(), -1).topk(k)
    return top.indices, top.values


def next_level(frontier_scores: torch.Tensor, child_logits: torch.Tensor, k: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The level below m expanded nodes (their scores [m], their children's logits [m, V]): each node's top-k children
    (draft ids [m*k]) with cumulative scores [m*k], node i's children at i*k..; and the next frontier: the indices of
    the best k of them."""
    child = torch.log_softmax(child_logits.float(), -1).topk(k)
    scores = (frontier_scores[:, None] + child.values).reshape(-1)
    return child.indices.reshape(-1), scores, scores.topk(min(k, scores.numel())).indices


def add_level(tokens: list[torch.Tensor], scores: list[torch.Tensor], parents: list[torch.Tensor],
              frontier: torch.Tensor, child_logits: torch.Tensor, k: int, expanded: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Append the level below the ``frontier`` candidates (expanded as nodes ``expanded``.., children's logits
    [m, V]) to the per-level ``tokens``, ``scores`` and ``parents`` lists, and return the next frontier: its candidate
    indices and its nodes' parents' expanded indices. Both tree builders below grow their levels through this."""
    candidates = sum(t.numel() for t in tokens)
    child_tokens, child_scores, best = next_level(torch.cat(scores)[frontier], child_logits, k)
    tokens.append(child_tokens)
    scores.append(child_scores)
    parents.append(frontier.repeat_interleave(k))
    return candidates + best, expanded + best // k


def keep_best(tokens: list[torch.Tensor], scores: list[torch.Tensor], parents: list[torch.Tensor], total: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE-2's re-ranking: of every level's candidates (draft ids, cumulative scores, parent candidate index; levels
    in order), the best ``total`` -> (their draft ids, parents re-indexed among them (-1 = the root), levels). Ties go
    to the shallower node, so a kept node's parent (score >= its child's) is always kept: sort by depth, then stably by
    score; candidate order is topological, and the kept nodes keep it."""
    all_tokens, all_scores, all_parents = torch.cat(tokens), torch.cat(scores), torch.cat(parents)
    levels = torch.cat([torch.full_like(t, i + 1) for i, t in enumerate(tokens)])
    by_depth = torch.argsort(levels, stable=True)
    order = by_depth[torch.argsort(all_scores[by_depth], descending=True, stable=True)]
    keep = order[:total].sort().values
    new_index = torch.full_like(all_tokens, -1)
    new_index[keep] = torch.arange(keep.numel(), device=keep.device)
    kept_parents = all_parents[keep]
    return all_tokens[keep], torch.where(kept_parents >= 0, new_index[kept_parents.clamp(min=0)], kept_parents), levels[keep]


def grow_static_tree(expand: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                                      tuple[torch.Tensor, torch.Tensor]],
                     hidden: torch.Tensor, root_logits: torch.Tensor, committed: torch.Tensor, max_len: int, depth: int,
                     topk: int, total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``build_dynamic_tree``'s tree at static shapes, for a drafter to compile as one graph: the same levels and
    re-ranking (``root_level``, ``next_level``, ``keep_best``), each level's k nodes run as ``tree_expand`` runs them.

    ``expand(level, hidden [1, k, H], draft ids [1, k], positions [1, k], allowed [k, max_len])`` runs one level's k
    nodes in the drafter's cache, written from slot ``committed + level * k``, and returns their outputs [1, k, H] and
    their children's logits [k, V]; rotary position ``committed + level``; ``allowed``: the committed slots, the node's expanded ancestors
    and itself. ``hidden`` [1, 1, H] and ``root_logits`` [V]: the last committed output and its logits; ``committed``
    (a 0-d tensor: the number of committed slots) is read inside the graph. Returns the kept nodes' draft ids,
    parents, levels and their verify block's ancestor mask."""
    k, device = topk, root_logits.device
    expanded = k * (depth - 1)  # every level but the last expands its k best nodes
    first_tokens, first_scores = root_level(root_logits, k)
    tokens, scores = [first_tokens], [first_scores]
    parents = [torch.full((k,), -1, dtype=torch.long, device=device)]
    frontier = torch.arange(k, device=device)  # candidate indices of the nodes to expand
    frontier_parent = torch.full((k,), -1, dtype=torch.long, device=device)  # expanded index of their parents
    outs = torch.cat([hidden[0], hidden.new_zeros(expanded, hidden.shape[-1])])  # row 1 + e: node e's output
    ancestors = torch.zeros(1 + expanded, expanded, dtype=torch.bool, device=device)  # row 1 + e: e's, and e
    tree_slots = committed + torch.arange(expanded, device=device)
    context = torch.arange(max_len, device=device) < committed
    for level in range(depth - 1):
        level_tokens = torch.cat(tokens)
        nodes = level * k + torch.arange(k, device=device)
        rows = ancestors[frontier_parent + 1].clone()
        rows[torch.arange(k, device=device), nodes] = True
        ancestors[1 + level * k:1 + (level + 1) * k] = rows
        allowed = context.expand(k, -1).clone()
        allowed.index_copy_(1, tree_slots, rows)
        out, child_logits = expand(level, outs[frontier_parent + 1].unsqueeze(0), level_tokens[frontier].view(1, k),
                                   (committed + level).expand(1, k), allowed)
        outs[1 + level * k:1 + (level + 1) * k] = out[0]
        frontier, frontier_parent = add_level(tokens, scores, parents, frontier, child_logits, k, level * k)
    kept, kept_parents, levels = keep_best(tokens, scores, parents, total)
    return kept, kept_parents, levels, ancestor_mask(kept_parents, depth)


def build_dynamic_tree(drafter, spec: DynamicTree, max_depth: int) -> DraftTree:
    """The round's dynamic tree of ``spec``, at most ``max_depth`` levels deep (the length budget): the drafter's
    ``grow_tree`` (decode/drafter.py), which for a drafter of ranked candidates is ``expand_dynamic_tree``."""
    return drafter.grow_tree(spec, max_depth)


def expand_dynamic_tree(drafter: TreeDrafter, spec: DynamicTree, max_depth: int) -> DraftTree:
    """The EAGLE-2 tree, at most ``max_depth`` levels deep (the length budget). A drafter whose ``dynamic_tree`` returns
    one builds the full-depth tree as one compiled graph (the same tree: heads/eagle3/drafter.py); the level-by-level
    form below otherwise, and for the shallower trees of a generation's last rounds."""
    depth = min(spec.depth, max_depth)
    if depth == spec.depth:
        built = drafter.dynamic_tree(spec)
        if built is not None:
            tokens, parents, levels, mask = built
            tree = DraftTree(tokens, parents, levels, depth)
            tree.__dict__["block_mask"] = mask  # computed in the same graph (the cached property's slot)
            return tree
    root = drafter.tree_root().reshape(-1)
    k = min(spec.topk, root.numel())
    if depth <= 0:
        return _empty(root.device)
    first_tokens, first_scores = root_level(root, k)
    tokens, scores = [first_tokens], [first_scores]  # per level, in candidate order
    parents = [torch.full((k,), -1, dtype=torch.long, device=root.device)]  # candidate index of the parent
    frontier = torch.arange(k, device=root.device)  # candidates to expand next (the whole first level)
    frontier_expanded_parent = torch.full((k,), -1, dtype=torch.long, device=root.device)
    expanded = 0  # nodes expanded so far
    for d in range(2, depth + 1):
        logits = drafter.tree_expand(frontier_expanded_parent, torch.cat(tokens)[frontier], d - 1)  # [m, V]
        m = frontier.numel()
        frontier, frontier_expanded_parent = add_level(tokens, scores, parents, frontier, logits, k, expanded)
        expanded += m
    kept, kept_parents, levels = keep_best(tokens, scores, parents, spec.total_tokens)
    return DraftTree(drafter.to_target(kept), kept_parents, levels, depth)


def build_static_tree(drafter: TreeDrafter, spec: StaticTree, max_depth: int) -> DraftTree:
    """The fixed tree of ``spec.paths`` (paths deeper than ``max_depth`` dropped)."""
    paths = sorted((p for p in spec.paths if len(p) <= max_depth), key=lambda p: (len(p), p))
    root = drafter.tree_root().reshape(-1)
    if not paths:
        return _empty(root.device)
    index = {p: i for i, p in enumerate(paths)}
    device = root.device
    draft_ids = torch.empty(len(paths), dtype=torch.long, device=device)
    expanded_id: dict[tuple[int, ...], int] = {}  # node path -> its index among expanded nodes
    level_logits = {(): root.unsqueeze(0)}  # path of an expanded node -> its children's logits
    row_of: dict[tuple[int, ...], int] = {(): 0}
    depth = max(len(p) for p in paths)
    for d in range(1, depth + 1):
        level = [p for p in paths if len(p) == d]
        for p in level:
            logits = level_logits[p[:-1]][row_of[p[:-1]]]
            draft_ids[index[p]] = logits.topk(p[-1] + 1).indices[p[-1]]
        to_expand = [p for p in level if any(len(q) == d + 1 and q[:-1] == p for q in paths)]
        if to_expand:
            parents = torch.tensor([expanded_id.get(p[:-1], -1) for p in to_expand], device=device)
            toks = draft_ids[torch.tensor([index[p] for p in to_expand], device=device)]
            logits = drafter.tree_expand(parents, toks, d)
            for r, p in enumerate(to_expand):
                expanded_id[p] = len(expanded_id)
                level_logits[p], row_of[p] = logits, r
    parents_out = torch.tensor([index[p[:-1]] if len(p) > 1 else -1 for p in paths], device=device)
    depths = torch.tensor([len(p) for p in paths], device=device)
    return DraftTree(drafter.to_target(draft_ids), parents_out, depths, depth)


class Trie:
    """A round's nodes as a trie of token paths (a drafter that merges several proposals: Lookahead's window and
    guesses, staged drafting's two chains): a path is one node however often it is added, parents before children, so
    siblings are distinct tokens, as ``verify_tree`` needs."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.index: dict[tuple[int, int], int] = {}

    def child(self, node: int, token: int) -> int:
        """The node for ``token`` below ``node`` (-1: the root), added where it is new."""
        found = self.index.get((node, token))
        if found is None:
            found = self.index[(node, token)] = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(node)
            self.depths.append(self.depths[node] + 1 if node >= 0 else 1)
        return found

    def add(self, path: list[int] | tuple[int, ...]) -> int:
        """The node at the end of ``path`` from the root, its nodes added where new."""
        node = -1
        for token in path:
            node = self.child(node, token)
        return node

    def tree(self, device: torch.device) -> DraftTree:
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        return DraftTree(as_tensor(self.tokens), as_tensor(self.parents), as_tensor(self.depths), max(self.depths, default=0))


def verify_tree(tree: DraftTree, choice: torch.Tensor, block_tokens: torch.Tensor,
                kept: torch.Tensor | None = None) -> tuple[list[int], list[int]]:
    """Walk the tree along the target's choices.

    ``choice`` [1+n] is the target's token at each block position: its argmax (greedy) or one sample
    from its warped distribution (sampling). A node is accepted when it equals its parent's choice and
    so are all its ancestors; the deepest accepted node ends the path and its choice is emitted next.

    With deterministic (top-k) children this is the multi-candidate rejection rule of SpecInfer and
    EAGLE with q one-hot: trying children x_1, x_2, ... in turn, accepting x_i with probability
    p'(x_i) and otherwise zeroing x_i in p', accepts child x_i with total probability p(x_i) and
    falls through to a sample of p restricted to the other tokens -- the law of one sample of p. So
    one sample per node is exactly lossless, vectorised, and needs a single host transfer.

    ``kept`` [n]: which nodes a rule other than equality keeps (typical acceptance, decode/typical.py: several siblings
    can pass: the deepest wins, the first in block order among equals); ``choice`` still gives the token
    emitted after the path.

    Returns (path [block indices, root first], emitted tokens [accepted drafts..., next token]).
    """
    right = tree.tokens == choice[tree.parents + 1] if kept is None else kept
    correct = torch.cat([torch.ones(1, dtype=torch.bool, device=choice.device), right])
    anc = tree.block_mask
    ok = (~anc | correct[None, :]).all(dim=1)  # [1+n]: the node and all its ancestors are right
    depth = torch.where(ok, tree.block_depths(), -1)
    best = depth.argmax()  # siblings are distinct tokens, so at most one node per depth equals the choice
    n1 = block_tokens.numel()
    packed = torch.cat([anc[best].long(), block_tokens, choice[best].view(1)]).tolist()  # the one host transfer
    path = [i for i in range(n1) if packed[i]]
    return path, [packed[n1 + i] for i in path[1:]] + [packed[-1]]


class ExpandedNodes:
    """A drafter's record of the tree nodes it has run this round: the ancestor mask among them, so
    each new node attends to its expanded ancestors and itself (shared by the EAGLE-3 and draft-model
    drafters)."""

    def __init__(self, device: torch.device) -> None:
        self.anc = torch.zeros(0, 0, dtype=torch.bool, device=device)

    @property
    def count(self) -> int:
        return self.anc.shape[0]

    def add(self, parents: torch.Tensor) -> torch.Tensor:
        """Record m nodes with these parents (-1 = root); returns their rows [m, count + m] of the mask."""
        m, done, device = parents.numel(), self.count, self.anc.device
        parent_rows = torch.cat([torch.zeros(1, done, dtype=torch.bool, device=device), self.anc])[parents + 1]
        rows = torch.cat([parent_rows, torch.eye(m, dtype=torch.bool, device=device)], dim=1)
        self.anc = torch.cat([torch.cat([self.anc, rows.new_zeros(done, m)], dim=1), rows])
        return rows


def best_static_tree(accuracy: torch.Tensor, num_nodes: int) -> list[tuple[int, ...]]:
    """The Medusa paper's tree construction: the ``num_nodes`` rank paths of highest expected acceptance.

    ``accuracy[d, r]`` is the measured probability that level d+1's rank-r candidate is right (for
    Medusa, head d+1's rank-r token; ``decode.medusa_drafter.rank_accuracy``). Treating levels as
    independent, a path is accepted with the product of its levels' accuracies, and the expected
    number of accepted drafts is the sum of that over the tree's nodes. A child never scores above
    its parent, so adding the best node adjacent to the tree each time is optimal and keeps every
    prefix in the tree. Returns the paths, shallow first."""
    depth, ranks = accuracy.shape
    acc = accuracy.double().tolist()
    frontier = [(-acc[0][r], (r,)) for r in range(ranks)]
    heapq.heapify(frontier)
    chosen: list[tuple[int, ...]] = []
    while frontier and len(chosen) < num_nodes:
        score, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < depth:
            for r in range(ranks):
                heapq.heappush(frontier, (score * acc[len(path)][r], path + (r,)))
    return sorted(chosen, key=lambda p: (len(p), p))


def expected_accept_length(paths: list[tuple[int, ...]], accuracy: torch.Tensor) -> float:
    """1 + the expected number of accepted drafts of a static tree under ``accuracy`` (see best_static_tree)."""
    acc = accuracy.double().tolist()
    return 1.0 + sum(math.prod(acc[d][r] for d, r in enumerate(p)) for p in paths)
