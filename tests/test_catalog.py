"""Drafter capabilities are declared data: every catalog entry's are read before any weight loads, every declared one
runs greedy-exact, every undeclared one is refused by the flag's name, and no code asks a drafter ``hasattr``."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from test_registry import target_dir, target_for  # noqa: F401 (target_dir: the tiny target's fixture)

from headstart.decode.batch_generate import PerSequence, batch_plain_generate, batch_speculative_generate
from headstart.decode.drafter import Capabilities, Drafter
from headstart.decode.generate import plain_generate, speculative_generate
from headstart.decode.target_runner import RaggedRunner, TargetRunner
from headstart.decode.tree import DynamicTree, StaticTree
from headstart.decode.verify import Sampling
from headstart.heads.methods import drafting_methods
from headstart.heads.registry import HEADS, build_head, drafter_for
from headstart.models.head import DraftConfig
from headstart.scripts import benchmark

REPO = Path(__file__).resolve().parents[1]

DRAFTER_NAMES = {n for n in dir(Drafter) if not n.startswith("__")} | {f.name for f in dataclasses.fields(Capabilities)} | {
    "precompile", "precompile_batch", "tree_root", "tree_expand", "to_target", "begin_batch", "update_batch", "select"}
"""What a drafter has or declares: asking for any of these by name is probing a drafter."""


def test_no_code_probes_a_drafter_for_what_it_can_do():
    """decode/ and heads/ read a drafter's declared capabilities; no getattr/hasattr names a drafter's method."""
    found = []
    for path in sorted([*(REPO / "decode").rglob("*.py"), *(REPO / "heads").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value in DRAFTER_NAMES):
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
    assert found == []


def test_capabilities_are_checked_when_declared():
    with pytest.raises(ValueError, match="unknown tree kind"):
        Capabilities(trees=("beam",))
    with pytest.raises(ValueError, match="compiled_batch needs compiled and batches"):
        Capabilities(compiled_batch=True)


def test_every_entry_declares_its_capabilities_on_its_drafter():
    for name, m in drafting_methods().items():
        assert isinstance(m.capabilities, Capabilities), name
    for name, spec in HEADS.items():
        assert issubclass(spec.drafter, Drafter) and spec.capabilities is spec.drafter.capabilities, name
        # A self-speculative drafter runs the target's layers itself; any other reads what its head trains on.
        assert spec.capabilities.reads_aux == (spec.cls.needs.aux_hidden_states and not spec.capabilities.self_verify), name


FLAGS = {  # a capability -> the flags that ask for it
    "dynamic trees": ["--tree"],
    "static trees": ["--tree-paths", "paths.json"],
    "batches": ["--batch-size", "2"],
    "confidence": ["--confidence-threshold", "0.5"],
}


def declared(m, what: str) -> bool:
    can = m.capabilities
    return {"dynamic trees": "dynamic" in can.trees, "static trees": "static" in can.trees, "batches": can.batches,
            "confidence": can.confidence}[what]


@pytest.mark.parametrize("what", sorted(FLAGS))
@pytest.mark.parametrize("name", sorted(drafting_methods()))
def test_a_flag_is_refused_by_name_exactly_where_its_capability_is_not_declared(name, what):
    """Before any weight loads: the method catalog's refusal names the flag and the method."""
    m = drafting_methods()[name]
    p = benchmark.build_parser()
    args = p.parse_args(["--target", "t", "--questions", "q", "--out", "o", "--method", name, "--draft", "d", *FLAGS[what]])
    refused = m.unsupported(name, args)
    if declared(m, what):
        assert refused is None
    else:
        assert refused is not None and refused.split(":")[0].split()[0] == FLAGS[what][0] and f"--method {name}" in refused


def test_a_method_refused_by_its_capabilities_fails_before_loading_anything(capsys):
    """``headstart bench`` stops at its flags: the target and --draft paths here do not exist."""
    with pytest.raises(SystemExit) as stop:
        benchmark.main(["--target", "/nonexistent", "--questions", "/nonexistent.jsonl", "--out", "/nonexistent-out",
                        "--method", "early-exit", "--draft", "/nonexistent-head", "--tree"])
    assert stop.value.code == 2
    assert "--tree: --method early-exit cannot draft a dynamic tree" in capsys.readouterr().err


PROMPTS = [torch.tensor([[1, 5, 9, 14, 3, 7]]), torch.tensor([[2, 8, 4]])]


@pytest.mark.slow  # about 45 s for the catalog: with CI's slow tests, out of the default suite's ten minutes
@pytest.mark.parametrize("name", sorted(HEADS))
def test_every_head_decodes_greedy_exact_in_every_shape_it_declares(name, target_dir):  # noqa: F811
    """A random head on a tiny target: chains always; dynamic and static trees, batches and sampled q exactly where
    its drafter declares them. Random drafts are mostly rejected, so exactness is what this checks."""
    torch.manual_seed(0)
    target = target_for(name, target_dir)
    spec = HEADS[name]
    can = spec.capabilities
    small = {"draft_vocab_size": 48} if "draft_vocab_size" in {f.name for f in dataclasses.fields(spec.options)} else {}
    head = build_head(DraftConfig(head=name, options=spec.options(**small)), target,
                      torch.arange(target.config.vocab_size, dtype=torch.float32)).eval()
    runner = TargetRunner(target, max_len=64, with_aux=can.reads_aux)
    n = 10
    for prompt in PROMPTS:
        want = plain_generate(runner, prompt, n, set()).tokens
        shapes = [None] + [DynamicTree(3, 2, 6)] * ("dynamic" in can.trees) + [StaticTree(((0,), (1,), (0, 0)))] * (
            "static" in can.trees)
        for tree in shapes:
            got = speculative_generate(runner, drafter_for(head, 64), prompt, n, set(), k=3, tree=tree)
            assert got.tokens == want, (name, tree)
    if "dynamic" not in can.trees:  # undeclared: the drafter cannot draft one (the catalog refuses --tree first)
        with pytest.raises((ValueError, TypeError, NotImplementedError)):
            speculative_generate(runner, drafter_for(head, 64), PROMPTS[0], n, set(), k=3, tree=DynamicTree(3, 2, 6))
    drafter = drafter_for(head, 64)
    if can.self_verify:
        drafter.attach(runner)
    drafter.begin(PROMPTS[0], runner_states(runner, PROMPTS[0]), 0)
    _, q = drafter.propose_sampled(3, Sampling(0.8), torch.Generator().manual_seed(0))
    assert (q is not None) == can.sampled, name  # sampled drafts carry their q; the others are one-hot (None)
    if can.batches:
        ragged = RaggedRunner(target, max_len=64, with_aux=can.reads_aux)
        plain, _ = batch_plain_generate(ragged, PROMPTS, n, set())
        batch_drafter = drafter_for(head, 64)
        outs, _ = batch_speculative_generate(ragged, batch_drafter, PROMPTS, n, set(), k=3)
        assert [o.tokens for o in outs] == [o.tokens for o in plain], name
        outs, _ = batch_speculative_generate(ragged, PerSequence([drafter_for(head, 64) for _ in PROMPTS]), PROMPTS, n,
                                             set(), k=3)
        assert [o.tokens for o in outs] == [o.tokens for o in plain], name


def runner_states(runner: TargetRunner, prompt: torch.Tensor):
    """The target's states over ``prompt``, as the loop hands them to ``begin``."""
    runner.reset()
    _, states = runner.forward(prompt)
    runner.commit(prompt.shape[1])
    return states
