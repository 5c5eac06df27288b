"""Draft trees: construction (EAGLE-2 dynamic, static paths), verification, and exact greedy output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import random_eagle3_head, tiny_causal_lm

from headstart.decode.draft_model import DraftModelDrafter
from headstart.heads.eagle3.drafter import Eagle3Drafter
from headstart.decode.generate import greedy_generate, speculative_generate
from headstart.heads.medusa.drafter import MedusaDrafter
from headstart.heads.mtp.drafter import MTPDrafter
from headstart.decode.target_runner import TargetRunner
from headstart.decode.drafter import Capabilities, Drafter
from headstart.decode.tree import DraftTree, DynamicTree, StaticTree, build_dynamic_tree, build_static_tree, verify_tree
from headstart.heads.medusa.module import MedusaConfig, MedusaHeads
from headstart.heads.mtp.module import build_mtp
from headstart.models.target import Target


class TableDrafter(Drafter):
    capabilities = Capabilities(trees=("dynamic", "static"))

    """Children logits are a fixed function of the node's token: a test double that logs its calls."""

    def __init__(self, vocab: int = 12, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.root = torch.randn(vocab, generator=g) * 2
        self.table = torch.randn(vocab, vocab, generator=g) * 2
        self.calls: list[tuple[list[int], list[int], int]] = []

    def tree_root(self):
        return self.root

    def tree_expand(self, parents, tokens, depth):
        self.calls.append((parents.tolist(), tokens.tolist(), depth))
        return self.table[tokens]

    def to_target(self, ids):
        return ids + 100  # a visible draft -> target id map


def reference_eagle2(d: TableDrafter, depth: int, topk: int, total: int) -> set[tuple[int, ...]]:
    """EAGLE-2 written plainly: paths (target ids) of the kept nodes."""
    logp = lambda logits: torch.log_softmax(logits, -1)  # noqa: E731
    level = [((int(t),), float(s)) for s, t in zip(*logp(d.root).topk(topk))]
    nodes = list(level)
    for _ in range(depth - 1):
        frontier = sorted(level, key=lambda n: -n[1])[:topk]
        level = []
        for path, score in frontier:
            values, ids = logp(d.table[path[-1]]).topk(topk)
            level += [(path + (int(t),), score + float(v)) for v, t in zip(values, ids)]
        nodes += level
    kept = sorted(nodes, key=lambda n: (-n[1], len(n[0])))[:total]
    return {tuple(t + 100 for t in path) for path, _ in kept}


def tree_paths(tree: DraftTree) -> set[tuple[int, ...]]:
    paths = []
    for i in range(tree.size):
        parent = int(tree.parents[i])
        paths.append((paths[parent] if parent >= 0 else ()) + (int(tree.tokens[i]),))
    return set(paths)


def test_block_mask_is_the_ancestor_relation():
    tree = DraftTree(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, -1, 0, 2]), torch.tensor([1, 1, 2, 3]), 3)
    expected = torch.tensor([[1, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0],
                             [1, 0, 1, 0, 0],
                             [1, 1, 0, 1, 0],
                             [1, 1, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(tree.block_mask, expected)
    assert tree.block_depths().tolist() == [0, 1, 1, 2, 3]


def test_verify_tree_follows_the_targets_choices():
    tree = DraftTree(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, -1, 0, 2]), torch.tensor([1, 1, 2, 3]), 3)
    block = torch.tensor([9, 5, 6, 7, 8])
    # choice at [root, 5, 6, 7, 8]: root -> 5, node 5 -> 7, node 7 -> 3 (not 8): path root,5,7; emit 5,7,3
    assert verify_tree(tree, torch.tensor([5, 7, 0, 3, 0]), block) == ([0, 1, 3], [5, 7, 3])
    assert verify_tree(tree, torch.tensor([6, 7, 0, 8, 2]), block) == ([0, 2], [6, 0])  # second branch
    assert verify_tree(tree, torch.tensor([4, 7, 0, 8, 2]), block) == ([0], [4])  # nothing accepted
    assert verify_tree(tree, torch.tensor([5, 7, 0, 8, 2]), block) == ([0, 1, 3, 4], [5, 7, 8, 2])  # all + bonus


@pytest.mark.parametrize("depth,topk,total", [(1, 3, 2), (3, 3, 10), (4, 2, 30), (3, 4, 5)])
def test_dynamic_tree_matches_a_plain_eagle2(depth, topk, total):
    d = TableDrafter()
    tree = build_dynamic_tree(d, DynamicTree(depth, topk, total), max_depth=10)
    assert tree_paths(tree) == reference_eagle2(d, depth, topk, total)
    assert tree.size == min(total, topk + (depth - 1) * topk * topk)
    assert (tree.parents < torch.arange(tree.size)).all()  # topological
    has_parent = tree.parents >= 0
    assert torch.equal(tree.depths[has_parent], tree.depths[tree.parents[has_parent]] + 1)
    assert [c[2] for c in d.calls] == list(range(1, depth))  # one batched expansion per level


def test_dynamic_tree_respects_the_length_budget():
    assert build_dynamic_tree(TableDrafter(), DynamicTree(5, 3, 40), max_depth=2).depths.max() == 2
    assert build_dynamic_tree(TableDrafter(), DynamicTree(5, 3, 40), max_depth=0).size == 0


def test_static_tree_picks_the_listed_ranks():
    d = TableDrafter()
    spec = StaticTree(((0,), (1,), (0, 0), (0, 2), (1, 0), (0, 0, 1)))
    tree = build_static_tree(d, spec, max_depth=10)
    rank = lambda logits, r: int(logits.topk(r + 1).indices[r])  # noqa: E731
    a, b = rank(d.root, 0), rank(d.root, 1)
    aa = rank(d.table[a], 0)
    expected = {(a,), (b,), (a, aa), (a, rank(d.table[a], 2)), (b, rank(d.table[b], 0)), (a, aa, rank(d.table[aa], 1))}
    assert tree_paths(tree) == {tuple(t + 100 for t in p) for p in expected}
    assert len(build_static_tree(d, spec, max_depth=1).tokens) == 2
    with pytest.raises(ValueError, match="no parent path"):
        StaticTree(((0,), (1, 0)))


def test_the_shipped_static_tree_expands_only_nodes_with_children():
    paths = json.loads((Path(__file__).parents[1] / "configs" / "trees" / "small-12.json").read_text())
    d = TableDrafter()
    tree = build_static_tree(d, StaticTree(tuple(tuple(p) for p in paths)), max_depth=10)
    assert tree.size == 12 and int(tree.depths.max()) == 5
    # one draft forward per level that has children, fed only the nodes that have them
    assert [len(tokens) for _, tokens, _ in d.calls] == [2, 2, 1, 1]


@pytest.fixture(scope="module")
def world():
    model = tiny_causal_lm("llama", num_hidden_layers=8)
    target = Target(model)
    head = random_eagle3_head(target)
    small = tiny_causal_lm("llama", num_hidden_layers=2)
    runner = TargetRunner(target, max_len=192)
    phrase = torch.randint(3, 128, (9,), generator=torch.Generator().manual_seed(3))
    prompt = torch.cat([phrase, phrase, phrase[:4]]).unsqueeze(0)
    return model, runner, head, small, prompt


def random_medusa_heads(target, num_heads: int = 4) -> MedusaHeads:
    heads = MedusaHeads(MedusaConfig.from_target(target.config, num_heads))
    heads.load_target_lm_head(target.lm_head_weight)
    torch.manual_seed(5)
    with torch.no_grad():
        for block in heads.blocks:
            for layer in block.layers:
                layer.weight.normal_(0, 0.2)
    return heads


def make_drafter(kind, world):
    model, runner, head, small, _ = world
    if kind == "eagle3":
        return Eagle3Drafter(head, 192)
    if kind == "medusa":
        return MedusaDrafter(random_medusa_heads(runner.target))
    if kind == "mtp":  # a fresh layer: the target's last layer behind random fusion weights
        return MTPDrafter(build_mtp(runner.target), 192)
    return DraftModelDrafter(model if kind == "self-draft" else small, 192, model.config.vocab_size)


def test_eagle3_tree_of_width_one_is_its_chain(world):
    _, runner, head, _, prompt = world
    drafter = Eagle3Drafter(head, 192)
    _, states = runner.forward(prompt)
    drafter.begin(prompt, states, 17)
    chain = drafter.propose(5)
    tree = build_dynamic_tree(drafter, DynamicTree(5, 1, 5), max_depth=10)
    assert torch.equal(tree.tokens, chain) and tree.parents.tolist() == [-1, 0, 1, 2, 3]


def test_draft_model_chain_equals_its_own_greedy_decoding(world):
    model, _, _, small, prompt = world
    drafter = DraftModelDrafter(small, 192, model.config.vocab_size)
    drafter.begin(prompt, None, 17)
    with torch.no_grad():
        own = small.generate(torch.cat([prompt, torch.tensor([[17]])], 1), max_new_tokens=6, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, -6:]
    assert drafter.propose(6).tolist() == own.tolist()


def test_a_reused_draft_model_drafter_keeps_nothing_of_the_last_requests_chain(world):
    """A drafter reused across requests whose first call after ``begin`` is an update (behind n-gram lookup, the
    hybrid's late read of the rounds it skipped) drafts what a fresh one does: the previous request's last chain, which
    no update committed, is not kept as this request's accepted drafts."""
    model, _, _, small, prompt = world
    reused = DraftModelDrafter(small, 192, model.config.vocab_size)
    reused.begin(prompt[:, :12], None, 5)
    reused.propose(4)  # a request's last round: drafted and verified, never updated
    fresh = DraftModelDrafter(small, 192, model.config.vocab_size)
    for drafter in (reused, fresh):
        drafter.begin(prompt, None, 17)
        drafter.update([40, 41, 42], None)
    assert reused.propose(4).tolist() == fresh.propose(4).tolist()
    assert torch.allclose(reused.last_logits, fresh.last_logits)


TREES = {"dynamic": DynamicTree(depth=4, topk=3, total_tokens=12), "static": StaticTree(((0,), (1,), (0, 0), (0, 1), (0, 0, 0)))}


@pytest.mark.parametrize("kind", ["eagle3", "medusa", "mtp", "draft-model", "self-draft"])
@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("max_new", [1, 2, 9, 40])
def test_tree_speculation_equals_greedy(world, kind, tree, max_new):
    _, runner, _, _, prompt = world
    reference = greedy_generate(runner, prompt, max_new, set()).tokens
    out = speculative_generate(runner, make_drafter(kind, world), prompt, max_new, set(), k=0, tree=TREES[tree])
    assert out.tokens == reference and len(out.tokens) == max_new
    if kind == "self-draft" and tree == "static" and max_new == 40:
        # The target drafting for itself: its argmax path (ranks 0, 0, 0) is in the tree and always taken.
        assert out.accepted[:5] == [3] * 5


@pytest.mark.parametrize("kind", ["eagle3", "medusa", "mtp", "draft-model"])
def test_chain_speculation_equals_greedy(world, kind):
    _, runner, _, _, prompt = world
    for k in (1, 4, 6):  # medusa: k = 6 > its 4 heads proposes 4
        out = speculative_generate(runner, make_drafter(kind, world), prompt, 30, set(), k=k)
        assert out.tokens == greedy_generate(runner, prompt, 30, set()).tokens


def test_eos_inside_an_accepted_tree_path_stops_exactly_there(world):
    _, runner, _, _, prompt = world
    reference = greedy_generate(runner, prompt, 40, set()).tokens
    tree = TREES["static"]  # self-drafting: rounds emit tokens 1-4, 5-8, ... (3 accepted + bonus)
    p = next(p for p in range(1, 40) if p % 4 != 0 and reference.index(reference[p]) == p)
    out = speculative_generate(runner, make_drafter("self-draft", world), prompt, 40, {reference[p]}, k=0, tree=tree)
    assert out.tokens == reference[: p + 1]


def test_medusa_drafts_are_each_heads_ranks_whatever_the_parent(world):
    _, runner, _, _, prompt = world
    heads = random_medusa_heads(runner.target, num_heads=3)
    drafter = MedusaDrafter(heads)
    _, states = runner.forward(prompt)
    drafter.begin(prompt, states, 17)
    logits = heads.head_logits(states.last_hidden_state[0, -1])  # [3, V]
    assert drafter.propose(5).tolist() == logits.argmax(-1).tolist()  # capped at 3 heads
    tree = build_static_tree(drafter, StaticTree(((0,), (1,), (0, 0), (1, 0), (1, 2), (1, 2, 0))), max_depth=10)
    top = logits.topk(3, -1).indices
    assert tree.tokens.tolist() == [top[0, 0], top[0, 1], top[1, 0], top[1, 0], top[1, 2], top[2, 0]]
    assert tree.parents.tolist() == [-1, -1, 0, 1, 1, 4]
    with pytest.raises(ValueError, match="predict 3 tokens ahead"):
        build_static_tree(drafter, StaticTree(((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))), max_depth=10)


class RecordingMedusaDrafter(MedusaDrafter):
    """Records the context each read of the target's state should correspond to."""

    def begin(self, prompt_ids, states, next_token):
        self.context = prompt_ids[0].tolist() + [next_token]
        self.reads = [(list(self.context), states.last_hidden_state[0, -1].clone())]
        super().begin(prompt_ids, states, next_token)

    def update(self, emitted, states):
        self.context += emitted
        self.reads.append((list(self.context), states.last_hidden_state[0, -1].clone()))
        super().update(emitted, states)


@pytest.mark.parametrize("tree", [None, "static"])
def test_medusa_reads_the_state_that_produced_the_last_emitted_token(world, tree):
    """After every round the drafter reads the target's final hidden state at the position whose
    output is the token just emitted: what a fresh forward over the context gives at that position."""
    _, runner, _, _, prompt = world
    drafter = RecordingMedusaDrafter(random_medusa_heads(runner.target))
    speculative_generate(runner, drafter, prompt, 30, set(), k=4, tree=None if tree is None else TREES[tree])
    assert len(drafter.reads) > 3
    for context, hidden in drafter.reads:
        fresh = runner.target(torch.tensor([context[:-1]])).last_hidden_state[0, -1]
        torch.testing.assert_close(hidden, fresh, rtol=1e-4, atol=1e-4)
