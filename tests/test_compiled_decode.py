"""The compiled decode path (``TargetRunner(compile=True)``: static KV cache, torch.compile; the drafters' steps
compiled at static shapes, decode/static_blocks.py) decodes exactly as the eager one. The default suite traces it with dynamo's ``eager`` backend (the graph capture and the static cache,
in seconds); the slow tests compile it with inductor."""

from __future__ import annotations

import pytest
import torch
from test_sampling_loop import V, chi2_vs, exact_joint, medusa_heads, sample_pairs
from tiny_models import random_eagle3_head, tiny_causal_lm

from headstart.benchmarks.drafter_launches import eager_ops
from headstart.decode.draft_model import DraftModelDrafter, draft_model_runner
from headstart.heads.eagle3.drafter import Eagle3Drafter
from headstart.decode.generate import plain_generate, speculative_generate
from headstart.decode.hybrid import HybridDrafter
from headstart.heads.medusa.drafter import MedusaDrafter
from headstart.heads.mtp.drafter import MTPDrafter
from headstart.decode.ngram import NgramDrafter
from headstart.decode.static_blocks import StaticBlocks
from headstart.decode.target_runner import TargetRunner
from headstart.decode.tree import DynamicTree, ancestor_mask, build_dynamic_tree
from headstart.heads.mtp.module import build_mtp
from headstart.models.target import Target

BACKENDS = ["eager", pytest.param("inductor", marks=pytest.mark.nightly)]
SLOW_BACKENDS = [pytest.param("eager", marks=pytest.mark.slow), pytest.param("inductor", marks=pytest.mark.nightly)]
"""For tests whose eager run alone takes 27-40 s here: with CI's slow tests, out of the default suite's ten minutes."""


def prompt() -> torch.Tensor:
    phrase = torch.randint(3, 128, (9,), generator=torch.Generator().manual_seed(3))
    return torch.cat([phrase, phrase, phrase[:4]]).unsqueeze(0)


def peaked_target() -> Target:
    """A tiny-vocabulary target with sharp distributions, for the chi-square tests (test_sampling_loop's setting)."""
    model = tiny_causal_lm("llama", num_hidden_layers=8, vocab_size=V)
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)
    return Target(model)


@pytest.fixture(scope="module")
def target():
    return Target(tiny_causal_lm("llama", num_hidden_layers=8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_chains_and_trees_equal_eager_greedy(target, backend):
    torch._dynamo.reset()
    eager, compiled = TargetRunner(target, 96), TargetRunner(target, 96, compile=True, backend=backend)
    p = prompt()
    reference = plain_generate(eager, p, 40, set()).tokens
    assert plain_generate(compiled, p, 40, set()).tokens == reference
    chain = speculative_generate(compiled, NgramDrafter(), p, 40, set(), k=4)
    assert chain.tokens == reference and sum(chain.accepted) > 0  # drafts were accepted: commits moved the cache
    # n-gram lookup's trees come in any size up to the total: each block runs padded to a compiled size
    ngram_tree = speculative_generate(compiled, NgramDrafter(), p, 40, set(), k=4,
                                      tree=DynamicTree(depth=4, topk=2, total_tokens=6))
    assert ngram_tree.tokens == reference and sum(ngram_tree.accepted) > 0
    head = random_eagle3_head(target)
    tree = DynamicTree(depth=3, topk=2, total_tokens=6)
    want = speculative_generate(eager, Eagle3Drafter(head, 96), p, 40, set(), k=4, tree=tree)
    got = speculative_generate(compiled, Eagle3Drafter(head, 96), p, 40, set(), k=4, tree=tree)
    assert got.tokens == reference == want.tokens and got.accepted == want.accepted
    # a two-layer draft's step compiled too (its static cache holds a layer each): chains and trees as eager
    layers = random_eagle3_head(target, num_layers=2)
    drafter = Eagle3Drafter(layers, 96, compile=True, backend=backend)
    for shape in (None, tree):
        want = speculative_generate(eager, Eagle3Drafter(layers, 96), p, 40, set(), k=4, tree=shape)
        got = speculative_generate(compiled, drafter, p, 40, set(), k=4, tree=shape)
        assert got.tokens == reference and got.accepted == want.accepted


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_compiled_head_behind_ngram_lookup_decodes_as_eager(target, backend):
    """The hybrid (decode/hybrid.py) over a compiled EAGLE-3 drafter: the skipped rounds read in commits of at most the
    precompiled size, every round drafted by the same drafter and accepted as with the eager head, chains and a tree."""
    torch._dynamo.reset()
    eager, compiled = TargetRunner(target, 96), TargetRunner(target, 96, compile=True, backend=backend)
    head, p = random_eagle3_head(target), prompt()
    reference = plain_generate(eager, p, 40, set()).tokens
    drafter = Eagle3Drafter(head, 96, compile=True, backend=backend)
    drafter.precompile(4)
    for tree in (None, DynamicTree(depth=3, topk=2, total_tokens=6)):
        want_h = HybridDrafter(Eagle3Drafter(head, 96), NgramDrafter(), 1.0)
        got_h = HybridDrafter(drafter, NgramDrafter(), 1.0, max_flush=4)
        want = speculative_generate(eager, want_h, p, 40, set(), k=3, tree=tree)
        got = speculative_generate(compiled, got_h, p, 40, set(), k=3, tree=tree)
        assert got.tokens == want.tokens == reference and got.accepted == want.accepted
        assert got_h.rounds == want_h.rounds and min(got_h.rounds.values()) > 0, got_h.rounds
        assert drafter._commits.causal_sizes <= {1, 2, 3, 4}  # no commit beyond the precompiled sizes


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_decoding_past_a_sliding_window_equals_eager(backend):
    torch._dynamo.reset()
    target = Target(tiny_causal_lm("gemma2", num_hidden_layers=8, sliding_window=8))
    eager, compiled = TargetRunner(target, 64), TargetRunner(target, 64, compile=True, backend=backend)
    p = prompt()
    reference = plain_generate(eager, p, 30, set()).tokens
    assert speculative_generate(compiled, NgramDrafter(), p, 30, set(), k=3).tokens == reference


def test_a_block_past_the_static_cache_is_refused_by_name(target):
    runner = TargetRunner(target, 24, compile=True, backend="eager")
    with pytest.raises(ValueError, match=r"KV cache overflow: 25 tokens > max_len 24 \(raise --max-len\)"):
        plain_generate(runner, prompt(), 40, set())


@pytest.mark.nightly
def test_compiled_speculative_sampling_follows_the_target():
    """Lossless on the compiled path (inductor): chi-square against the warped target's exact joint."""
    torch._dynamo.reset()
    target = peaked_target()
    runner = TargetRunner(target, 32, compile=True)
    torch.manual_seed(1)
    head = random_eagle3_head(target, draft_vocab_size=V)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    stat, critical = chi2_vs(sample_pairs(runner, lambda: Eagle3Drafter(head, 32), 2500, seed=0), exact_joint(target.model))
    assert stat < critical


def drafters(target, max_len: int, backend: str) -> dict:
    """Each drafter kind, eager and compiled: (make an eager drafter, the one compiled drafter every prompt reuses)."""
    torch.manual_seed(0)
    head = random_eagle3_head(target, draft_vocab_size=min(48, target.vocab_size))
    mtp, medusa = build_mtp(target), medusa_heads(target.model)
    small = tiny_causal_lm("llama", num_hidden_layers=2, vocab_size=target.vocab_size)
    return {
        "eagle3": (lambda: Eagle3Drafter(head, max_len), Eagle3Drafter(head, max_len, compile=True, backend=backend)),
        "mtp": (lambda: MTPDrafter(mtp, max_len), MTPDrafter(mtp, max_len, compile=True, backend=backend)),
        "medusa": (lambda: MedusaDrafter(medusa), MedusaDrafter(medusa, compile=True, backend=backend)),
        "draft-model": (lambda: DraftModelDrafter(small, max_len, target.vocab_size),
                        DraftModelDrafter(draft_model_runner(small, max_len, compile=True, backend=backend), max_len,
                                          target.vocab_size)),
    }


def lockstep(runner: TargetRunner, eager, compiled, p: torch.Tensor, k: int, rounds: int,
             descending: bool = False) -> list[list[int]]:
    """Drive both drafters through the same rounds: proposals compared every round, then a accepted of them (a = 0..k
    in turn, or k..0 with ``descending``, so that a block is padded to a larger size compiled before it: commits of
    every size) and a bonus token, with the target's states at those positions; a tree's root and two levels below it
    compared at the end. Returns the proposals."""
    runner.reset()
    logits, states = runner.forward(p)
    runner.commit(p.shape[1])
    token = int(logits[0, -1].argmax())
    for drafter in (eager, compiled):
        drafter.begin(p, states, token)
    proposals = []
    for r in range(rounds):
        drafts = eager.propose(k)
        assert compiled.propose(k).tolist() == drafts.tolist(), r
        proposals.append(drafts.tolist())
        a = (k - r) % (k + 1) if descending else r % (k + 1)
        _, states = runner.forward(torch.tensor([[token] + drafts.tolist()]))
        emitted = drafts[:a].tolist() + [(token * 7 + r) % 100 + 3]
        runner.commit(a + 1)
        kept = type(states)(**{f: None if v is None else v[:, : a + 1] for f, v in vars(states).items()})
        for drafter in (eager, compiled):
            drafter.update(emitted, kept)
        token = emitted[-1]
    want, got = eager.tree_root(), compiled.tree_root()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    top = want.topk(2).indices
    levels = {}
    for name, drafter in (("compiled", compiled), ("eager", eager)):
        first = drafter.tree_expand(torch.tensor([-1, -1]), top, 1)  # two children of the root
        # the top child of each: nodes that see the committed context, their own parent (an earlier block) and
        # themselves, one position further
        second = drafter.tree_expand(torch.tensor([0, 1]), first.argmax(-1), 2)
        levels[name] = (first, second)
    for got, want in zip(levels["compiled"], levels["eager"]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    return proposals


@pytest.mark.parametrize("backend", SLOW_BACKENDS)
def test_compiled_drafters_draft_exactly_as_eager(target, backend):
    """One compiled drafter per kind, reused over two prompts: every round's proposals (after commits of 1..k+1
    tokens), and a tree's root and first level, as a fresh eager drafter's; then whole generations, chains and a
    tree, on the compiled target give the eager tokens."""
    torch._dynamo.reset()
    runner, eager_runner = TargetRunner(target, 128, compile=True, backend=backend), TargetRunner(target, 128)
    prompts = [prompt(), torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(5))]
    tree = DynamicTree(depth=3, topk=2, total_tokens=6)
    for name, (make, compiled) in drafters(target, 128, backend).items():
        compiled.precompile(3)  # dummy blocks written at slot 0 first: the prompt's begin must overwrite them
        for i, p in enumerate(prompts):
            proposals = lockstep(eager_runner, make(), compiled, p, 4, 10, descending=i == 0)
            # the causal blocks its commits run in (EAGLE-3's and MTP's, the chain mask built in the graph)
            blocks = getattr(compiled, "_commits", None)
            if blocks is not None:  # precompiled 1..3, then commits of 5 and 4 (a commit reads its last row: no padding)
                assert {1, 2, 3, 4, 5} <= blocks.causal_sizes, name
            assert len({tuple(x) for x in proposals}) > 1, name  # the drafts follow the sequence
            reference = plain_generate(eager_runner, p, 30, set()).tokens
            for k, shape in ((4, None), (3, tree)):
                assert speculative_generate(runner, compiled, p, 30, set(), k=k, tree=shape).tokens == reference


def test_a_compiled_draft_step_past_its_cache_is_refused_by_name(target):
    drafter = Eagle3Drafter(random_eagle3_head(target), 20, compile=True, backend="eager")
    runner = TargetRunner(target, 96)
    with pytest.raises(ValueError, match=r"draft KV cache overflow: 2\d > max_len 20"):
        speculative_generate(runner, drafter, prompt(), 40, set(), k=4)


def test_a_block_is_padded_only_to_a_size_that_fits_the_cache():
    calls = []
    blocks = StaticBlocks(lambda h, t, pos, allowed: calls.append((t.shape[1], allowed.shape)) or h, 20,
                          torch.device("cpu"), backend="eager")
    blocks.compiled = blocks.step  # record the shapes the compiled step would get
    hidden, tokens = torch.zeros(1, 2, 4), torch.ones(1, 2, dtype=torch.long)
    blocks(torch.zeros(1, 5, 4), torch.ones(1, 5, dtype=torch.long), torch.arange(3, 8), torch.ones(5, 8, dtype=torch.bool), 3)
    assert blocks(hidden, tokens, torch.arange(10, 12), torch.ones(2, 12, dtype=torch.bool), 10).shape == (1, 2, 4)
    assert calls[-1] == (5, (5, 20))  # padded to the compiled 5: slots 10..14 fit
    blocks(hidden, tokens, torch.arange(17, 19), torch.ones(2, 19, dtype=torch.bool), 17)
    assert calls[-1] == (2, (2, 20)) and blocks.sizes == {5, 2}  # 17 + 5 > 20: a graph of its own


@pytest.mark.nightly
@pytest.mark.parametrize("drafter", ["eagle3", "mtp", "draft-model"])
def test_compiled_drafters_sample_the_target(drafter):
    """Lossless with a compiled drafter (inductor) on the compiled target: chi-square against the exact joint."""
    torch._dynamo.reset()
    target = peaked_target()
    runner = TargetRunner(target, 32, compile=True)
    compiled = drafters(target, 32, "inductor")[drafter][1]
    stat, critical = chi2_vs(sample_pairs(runner, lambda: compiled, 2500, seed=0), exact_joint(target.model))
    assert stat < critical


@pytest.mark.nightly
@pytest.mark.parametrize("drafter", ["eagle3", "mtp"])
def test_compiled_one_graph_trees_sample_the_target(drafter):
    """Lossless with a tree grown as one graph (inductor; depth 2 fits the first round's budget of the 4-token
    generations, so that round's tree is the graph's; a later round's shallower budget takes the level-by-level
    form): chi-square against the exact joint."""
    torch._dynamo.reset()
    target = peaked_target()
    runner = TargetRunner(target, 32, compile=True)
    compiled = drafters(target, 32, "inductor")[drafter][1]
    tree = DynamicTree(depth=2, topk=2, total_tokens=3)
    grown, whole = [], compiled.dynamic_tree

    def counted(spec: DynamicTree):
        out = whole(spec)
        grown.append(out is not None)
        return out

    compiled.dynamic_tree = counted
    stat, critical = chi2_vs(sample_pairs(runner, lambda: compiled, 2500, seed=0, tree=tree), exact_joint(target.model))
    assert stat < critical
    assert sum(grown) >= 2500  # every sample's first round grew its tree as the graph


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_a_compiled_chain_is_one_call(target, kind):
    """A compiled EAGLE-3 or MTP drafter drafts a greedy chain in one call of its compiled chain (no per-step block
    calls: the eager ops around each step were the draft's cost on a GPU), as the eager drafter does step by step; a
    shorter budget takes a prefix of the same chain."""
    if kind == "eagle3":
        head = random_eagle3_head(target)
        compiled, eager = Eagle3Drafter(head, 128, compile=True, backend="eager"), Eagle3Drafter(head, 128)
    else:
        head = build_mtp(target)
        compiled, eager = MTPDrafter(head, 128, compile=True, backend="eager"), MTPDrafter(head, 128)
    runner = TargetRunner(target, 128)
    p = prompt()
    logits, states = runner.forward(p)
    runner.commit(p.shape[1])
    for drafter in (compiled, eager):
        drafter.begin(p, states, int(logits[0, -1].argmax()))
    steps = []
    blocks = compiled._blocks
    compiled._blocks = lambda *a, **kw: steps.append(a) or blocks(*a, **kw)
    drafts = compiled.propose(4)
    assert steps == [] and drafts.tolist() == eager.propose(4).tolist() and compiled._chain.steps == 4
    assert len(set(drafts.tolist())) > 1  # the steps fed back: not one token repeated
    assert compiled.propose(2).tolist() == drafts[:2].tolist() and compiled._chain.steps == 4
    # a round: two drafts accepted and a bonus token read back, then the next chain, still as the eager drafter's
    _, states = runner.forward(torch.tensor([[int(logits[0, -1].argmax())] + drafts.tolist()]))
    kept = type(states)(**{f: None if v is None else v[:, :3] for f, v in vars(states).items()})
    for drafter in (compiled, eager):
        drafter.update(drafts[:2].tolist() + [7], kept)
    assert compiled.propose(4).tolist() == eager.propose(4).tolist()
    # reading tokens back records no autograd graph (a compiled commit run with grad on would also recompile)
    assert not compiled.last_logits.requires_grad and not eager.last_logits.requires_grad
    # its commit is a causal graph of its own: no step block ran at all
    assert steps == [] and 3 in compiled._commits.causal_sizes


def test_eager_op_count_leaves_out_compiled_graphs():
    from headstart.benchmarks.drafter_launches import eager_ops

    x = torch.randn(4)
    f = lambda: (x * 2 + 1).sin()  # noqa: E731
    g = torch.compile(lambda: (x * 2 + 1).sin(), backend="eager")
    g()
    assert eager_ops(f) == 3 and eager_ops(g) == 0
    assert eager_ops(lambda: x.view(2, 2)[0].unsqueeze(0)) == 0  # views launch nothing
    assert eager_ops(lambda: x.view(2, 2).clone()) == 1


def test_a_compiled_chain_round_launches_few_eager_ops(target):
    """The compiled EAGLE-3 and MTP drafters' rounds, counted as benchmarks/drafter_launches.py counts them: a chain of
    4 dispatches a handful of eager ops (it was ~100 as separate step graphs), and so does a commit (its chain mask
    and positions built inside its graph: it was 16-26); the target's compiled forward only fills its write slot (its
    mask was 15 eager ops)."""
    from headstart.benchmarks.drafter_launches import round_ops, target_ops

    eagle3 = round_ops(target, random_eagle3_head(target), 4, backend="eager")
    mtp = round_ops(target, build_mtp(target), 4, backend="eager")
    assert eagle3["propose"] <= 8 and mtp["propose"] <= 8
    assert 0 < eagle3["update"] <= 8 and 0 < mtp["update"] <= 8
    around = target_ops(target, 4, backend="eager")  # the target's own step: the same for 1 or 5 tokens
    assert around["step"] == around["verify"] == 1


def _root_paths(tree) -> set[tuple[int, ...]]:
    """A tree as the set of its nodes' token paths from the root: two trees are the same tree when these are (sibling
    order may differ where two children's scores tie to rounding)."""
    paths = set()
    for i in range(tree.size):
        path, j = [], i
        while j >= 0:
            path.append(int(tree.tokens[j]))
            j = int(tree.parents[j])
        paths.add(tuple(reversed(path)))
    return paths


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_a_compiled_dynamic_tree_is_one_graph_and_the_level_by_level_tree(target, kind, backend):
    """EAGLE-3's and MTP's whole EAGLE-2 tree as one graph (``dynamic_tree``) grows the tree the level-by-level form
    grows, with its verify mask, after commits of different lengths; a budget shallower than the tree takes the
    level-by-level form."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    drafter_cls, head = (Eagle3Drafter, random_eagle3_head(target)) if kind == "eagle3" else (MTPDrafter, build_mtp(target))
    spec = DynamicTree(depth=4, topk=3, total_tokens=10)
    runner = TargetRunner(target, 128)
    p = prompt()
    logits, states = runner.forward(p)
    runner.commit(p.shape[1])
    eager, compiled = drafter_cls(head, 128), drafter_cls(head, 128, compile=True, backend=backend)
    for drafter in (eager, compiled):
        drafter.begin(p, states, int(logits[0, -1].argmax()))
    for emitted in ([5], [9, 4, 17]):
        want = build_dynamic_tree(eager, spec, 10)
        got = build_dynamic_tree(compiled, spec, 10)
        assert got.max_depth == want.max_depth == 4 and got.size == want.size == 10
        assert _root_paths(got) == _root_paths(want) and len(_root_paths(want)) == 10
        assert torch.equal(got.block_mask, ancestor_mask(got.parents, got.max_depth))
        assert eager_ops(lambda: build_dynamic_tree(compiled, spec, 10)) <= 10  # one graph (level by level: ~100)
        block = torch.tensor([emitted], dtype=torch.long)
        _, states = runner.forward(block)
        runner.commit(len(emitted))
        for drafter in (eager, compiled):
            drafter.update(emitted, states)
    shallow = build_dynamic_tree(compiled, spec, 2)  # the last rounds' budget: level by level
    assert shallow.max_depth == 2 and _root_paths(shallow) == _root_paths(build_dynamic_tree(eager, spec, 2))


@pytest.mark.parametrize("backend", SLOW_BACKENDS)
def test_compiled_drafters_stop_unsure_chains_as_eager(target, backend, monkeypatch):
    """With a confidence threshold a compiled drafter leaves its one-graph chain for its compiled steps and stops where
    the eager drafter stops: the same proposals round by round and the same output. The rule is made to depend on
    the draft id (a random head's probabilities are all tiny), so both see the same cuts if they draft the same."""
    from headstart.decode import chain as draft_model  # every drafter's chain loop, with its rule, is decode/chain.py's
    from headstart.decode import chain as eagle3_drafter
    from headstart.decode import chain as mtp_drafter

    for module in (eagle3_drafter, mtp_drafter, draft_model):
        monkeypatch.setattr(module, "confident", lambda logits, draft, threshold, probs=None: int(draft.reshape(-1)[0]) % 3 != 0)
    torch._dynamo.reset()
    runner = TargetRunner(target, 128)
    for name, (make, compiled) in drafters(target, 128, backend).items():
        if name == "medusa":  # its parallel heads cut by confident_prefix, with no chain graph to leave
            continue
        compiled.precompile(5)
        eager = make()
        eager.confidence_threshold = compiled.confidence_threshold = 0.5
        want = speculative_generate(runner, eager, prompt(), 30, set(), k=4)
        got = speculative_generate(runner, compiled, prompt(), 30, set(), k=4)
        assert got.proposed == want.proposed and got.tokens == want.tokens, name
        assert any(n < 4 for n in want.proposed[:-2]), f"{name}: no chain was cut"
