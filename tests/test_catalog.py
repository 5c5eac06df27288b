"""The conformance suite: every head of the catalog (heads/registry.py) and every drafting method (heads/methods.py),
parametrized over the catalogs themselves -- no test file lists heads by hand. The test tree's toy head
(tests/toy_head/, registered by one line in tests/conftest.py) runs through all of it like a shipped head: a head is
its folder plus its catalog line.

Per head, on tiny random targets: its entry is complete; the loss falls over a few steps through the shared trainer;
each layout it declares exports, is detected as its own by its detector only, and loads back to the same weights and
drafts; ``check_head`` passes it for its target and refuses it for another by name; a published head starts a new
one; it decodes greedy-exact in every shape its drafter declares and is refused by flag name in every other (slow);
its sampled drafts keep the target's distribution (nightly). Per method: the flags it cannot take are refused before
any weight loads."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import subprocess
from pathlib import Path

import pytest
import torch
from test_sampling_loop import V, chi2_vs, exact_joint, sample_pairs, world  # noqa: F401 (world: the 8-token target)
from tiny_models import tiny_causal_lm
from trainer_fixtures import make_setup

from headstart.decode.batch_generate import PerSequence, batch_plain_generate, batch_speculative_generate
from headstart.decode.confidence import with_threshold
from headstart.decode.drafter import Capabilities, Drafter
from headstart.decode.generate import plain_generate, speculative_generate
from headstart.decode.target_runner import RaggedRunner, TargetRunner
from headstart.decode.tree import DynamicTree, StaticTree
from headstart.decode.verify import Sampling, Verification
from headstart.heads.exports import check_head, convert_head, detect_layout
from headstart.heads.methods import drafting_methods
from headstart.heads.registry import HEADS, SHARED_FIELDS, build_head, drafter_for, load_head, spec_of
from headstart.models.export import export_head
from headstart.models.head import DraftConfig, DraftHead
from headstart.models.provenance import OtherTargetError, fingerprint
from headstart.models.target import Target, TargetConfig
from headstart.models.train_compile import parts_of
from headstart.scripts import benchmark
from headstart.trainer.batches import collate
from headstart.trainer.config import load_config
from headstart.trainer.run import build_trainer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    tiny_causal_lm("llama", num_hidden_layers=8, head_dim=8).save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def other_target_dir(tmp_path_factory):
    """Another target whose hidden and vocab sizes are ``target_dir``'s (every head's tensors fit it), of another MLP
    width: a head trained for ``target_dir`` would load here and draft for the wrong model."""
    root = tmp_path_factory.mktemp("other-llama")
    tiny_causal_lm("llama", num_hidden_layers=8, head_dim=8, intermediate_size=48).save_pretrained(root)
    return root


def target_for(target_dir) -> Target:
    return Target.from_pretrained(TargetConfig(path=str(target_dir), dtype="float32"))


def tiny_head(name: str, target: Target, seed: int = 0) -> DraftHead:
    """A fresh head of the entry's small shape (``HeadSpec.tiny``) for ``target``."""
    torch.manual_seed(seed)
    spec = HEADS[name]
    return build_head(DraftConfig(head=name, options=spec.options(**spec.tiny)), target,
                      torch.arange(target.config.vocab_size, dtype=torch.float32))


def perturb(head: torch.nn.Module, scale: float = 0.05) -> None:
    """Away from any deterministic start (an identity block, the target's own layers): as a trained head is."""
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * scale)


# -- the entries --------------------------------------------------------------------------------------------------

def test_every_entry_is_complete_and_declares_its_capabilities():
    for name, spec in HEADS.items():
        own = {f.name for f in dataclasses.fields(spec.options)}
        assert own and not own & set(SHARED_FIELDS), name  # no head redefines a shared field
        assert set(spec.tiny) <= own, name  # its small instance sets its own fields only
        assert spec.cards and spec.title and spec.unit, name
        assert isinstance(spec.cls.needs.aux_hidden_states, bool), name
        assert issubclass(spec.drafter, Drafter) and spec.capabilities is spec.drafter.capabilities, name
        # A self-speculative drafter runs the target's layers itself; any other reads what its head trains on.
        assert spec.capabilities.reads_aux == (spec.cls.needs.aux_hidden_states and not spec.capabilities.self_verify), name
    for name, m in drafting_methods().items():
        assert isinstance(m.capabilities, Capabilities), name


def test_the_toy_head_is_in_the_catalog_by_one_line():
    """The proof that a head is its folder and one line: the toy head's is tests/conftest.py's, and every test
    parametrized over the catalog runs it."""
    assert "toy" in HEADS and HEADS["toy"].cls.__module__ == "toy_head.module"
    lines = [line for line in (REPO / "tests" / "conftest.py").read_text().splitlines() if "TOY" in line]
    assert lines == ["from toy_head.spec import TOY  # noqa: E402", 'register_head("toy", TOY)  # noqa: E402'], lines
    mentions = subprocess.run(["grep", "-rlw", "--include=*.py", "-e", "toy_head", "-e", "ToyHead", "-e", "TOY", str(REPO)],
                              capture_output=True, text=True).stdout.split()
    assert sorted(Path(m).relative_to(REPO).as_posix() for m in mentions if "/toy_head/" not in m) == [
        "tests/conftest.py", "tests/test_catalog.py"]


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
    with pytest.raises(ValueError, match="drafts its own trees"):
        Capabilities(chains=False)  # no chains: every round is its own tree, which it must declare


def test_shared_code_names_no_head():
    """The trainer, the feature pipeline, the decoder, export and the user commands hold no head name nor head class
    (tests/test_layers.py holds models/, decode/ and trainer/ to the same by their imports and strings): a new head
    is its folder plus its catalog line."""
    shared = [*sorted((REPO / "trainer").rglob("*.py")), *sorted((REPO / "decode").rglob("*.py")),
              REPO / "models" / "export.py", REPO / "models" / "head.py",
              *[p for p in sorted((REPO / "scripts").glob("*.py")) if p.name != "medusa_tree.py"]]  # Medusa's own tool
    names = "|".join(HEADS)
    found = subprocess.run(["grep", "-nE", rf"[\"']({names})[\"']", *map(str, shared)], capture_output=True, text=True).stdout
    # A default head in a help text or a recipe default is a value, not a branch: none is allowed here either.
    assert found == "", found
    classes = "|".join(spec.cls.__name__ for spec in HEADS.values())
    assert not re.search(rf"\b({classes})\b", subprocess.run(["cat", *map(str, shared)], capture_output=True, text=True).stdout)


# -- training, exports, detection, checks ------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(HEADS))
def test_a_head_trains_through_the_shared_trainer_and_every_layout_round_trips(name, tmp_path):
    """Six steps of the shared trainer lower the head's loss on a fixed batch; then each layout it declares exports,
    is detected as its own, and loads back to the same weights and the same drafts."""
    trainer = build_trainer(load_config(None, make_setup(tmp_path, head=name) + [
        "--train.lr=3e-3", "--train.eval_fraction=0", "--train.save_every=100"]))
    head = trainer.backend.module
    batch = collate(trainer.train_data, list(range(6)))
    features = trainer.features(batch)
    with torch.no_grad():
        before = head.loss(features)[0].item()
    trainer.train()
    with torch.no_grad():
        after = head.loss(features)[0].item()
    assert after < before, (name, before, after)
    assert spec_of(head) is HEADS[name]
    for path in type(head).compiled:  # train.compile's parts: each a module, a list of modules or a method of the head
        for _, owner, leaf in parts_of(head, path):  # a '*' over a module dict: each of its modules' (none: skipped)
            part = getattr(owner, leaf)
            assert isinstance(part, torch.nn.Module) or inspect.ismethod(part), (name, path)

    with torch.no_grad():  # exports are bf16: what trained is rounded first, so the round trip is exact (the frozen
        for p in head.parameters():  # parts are the target's, which a load takes from the target again)
            if p.requires_grad:
                p.copy_(p.to(torch.bfloat16).to(p.dtype))
    target_path = Path(trainer.config.target.path)
    target = Target.from_pretrained(TargetConfig(path=str(target_path), dtype="float32",
                                                 aux_layer_ids=trainer.config.target.aux_layer_ids))
    want = drafts_of(head, target, batch["input_ids"][:1, :12])
    for layout in head.layouts:
        out = tmp_path / f"export-{layout}"
        export_head(head, out, name, fingerprint(target_path), format=layout)
        assert layout in HEADS[name].cards  # every layout a head writes has a card
        assert detect_layout(out) == (name, layout)
        loaded = load_head(name, str(out), target)
        assert type(loaded) is HEADS[name].cls
        got, mine = loaded.state_dict(), head.state_dict()
        assert set(got) <= set(mine), (name, layout, sorted(set(got) - set(mine)))
        assert all(torch.equal(got[k], mine[k].to(got[k].device)) for k in got), (name, layout)
        assert drafts_of(loaded, target, batch["input_ids"][:1, :12]) == want, (name, layout)


def drafts_of(head, target: Target, prompt: torch.Tensor) -> list:
    """Greedy chains of 3 over 8 new tokens, and (for a sampled drafter) the first round's q: what the head drafts."""
    can = spec_of(head).capabilities
    runner = TargetRunner(target, max_len=64, with_aux=can.reads_aux)
    out = speculative_generate(runner, drafter_for(head.eval(), 64), prompt, 8, set(), k=3)
    drafter = drafter_for(head, 64)
    if can.self_verify:
        drafter.attach(runner)
    drafter.begin(prompt, runner_states(runner, prompt), out.tokens[0])
    _, q = drafter.propose_sampled(3, Sampling(0.8), torch.Generator().manual_seed(0))
    return [out.tokens, out.accepted, None if q is None else q.tolist()]


@pytest.fixture(scope="module")
def exports(target_dir, tmp_path_factory):
    """Every head of the catalog exported in every layout it declares: {(head, layout): directory}."""
    target, root, found = target_for(target_dir), tmp_path_factory.mktemp("exports"), {}
    for name in HEADS:
        head = tiny_head(name, target)
        for layout in head.layouts:
            found[name, layout] = export_head(head, root / f"{name}-{layout}", name, fingerprint(target_dir), format=layout)
    return found


@pytest.mark.parametrize("name", sorted(HEADS))
def test_each_detector_claims_its_own_exports_and_refuses_every_other(name, exports):
    import json

    spec = HEADS[name]
    for (head, layout), directory in exports.items():
        config = json.loads((directory / "config.json").read_text())
        assert spec.detect(directory, config) == (layout if head == name else None), (name, head, layout)


@pytest.mark.parametrize("name", sorted(HEADS))
def test_check_head_passes_a_head_for_its_target_and_refuses_it_for_another_by_name(name, exports, target_dir,
                                                                                  other_target_dir):
    for (head, layout), directory in exports.items():
        if head != name:
            continue
        what, problems, _ = check_head(directory, target_dir)
        assert what == f"{name} ({layout} layout)" and problems == [], (name, layout, problems)
        _, problems, _ = check_head(directory, other_target_dir)
        assert problems and problems[0].key == "target" and str(target_dir) in problems[0].message, (name, problems)


@pytest.mark.parametrize("name", sorted(HEADS))
def test_a_head_started_from_a_published_one_has_its_weights_and_vocab(name, target_dir, tmp_path):
    target = target_for(target_dir)
    spec = HEADS[name]
    published = tiny_head(name, target, seed=1)
    perturb(published)
    export_head(published, tmp_path / "pub", name, fingerprint(target_dir))
    want = load_head(name, str(tmp_path / "pub"), target).state_dict()
    # Other token counts and seed: a fresh head would differ in every weight and (with a draft vocab) in its map.
    torch.manual_seed(2)
    options = spec.options(**spec.tiny)
    counts = torch.arange(target.config.vocab_size, dtype=torch.float32).flip(0)
    fresh = build_head(DraftConfig(head=name, options=options), target, counts).state_dict()
    started = build_head(DraftConfig(head=name, options=options, init_from=str(tmp_path / "pub")), target, counts)
    got = started.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert any(not torch.equal(fresh[k], want[k]) for k in want)
    trained = [n for n, p in build_head(DraftConfig(head=name, options=options), target, counts).named_parameters()
               if p.requires_grad]  # loading keeps what trains and what stays frozen (the target's embeddings)
    assert [n for n, p in started.named_parameters() if p.requires_grad] == trained
    other = dict(fingerprint(target_dir), config_sha256="0" * 16, name_or_path="/models/another")
    export_head(published, tmp_path / "other", name, other)
    with pytest.raises(OtherTargetError, match="another"):  # a head trained for another target is refused
        build_head(DraftConfig(head=name, options=options, init_from=str(tmp_path / "other")), target, counts)
    if "draft_vocab_size" in spec.tiny:  # another shape is refused, naming the tensors
        size = spec.tiny["draft_vocab_size"]
        with pytest.raises(ValueError, match=rf"does not fit this recipe's .* head[\s\S]*\({size}, .*there"):
            build_head(DraftConfig(head=name, options=spec.options(**{**spec.tiny, "draft_vocab_size": size // 2}),
                                   init_from=str(tmp_path / "pub")), target, counts)


def test_converting_a_head_with_one_layout_is_refused_by_name(exports, tmp_path):
    name, layout = next((n, l) for (n, l) in exports if len(HEADS[n].cls.layouts) == 1)
    with pytest.raises(ValueError, match=rf"holds {name} \({layout} layout\); .* are exported in \['{layout}'\], not 'other'"):
        convert_head(exports[name, layout], tmp_path / "out", "other")


# -- decoding ---------------------------------------------------------------------------------------------------

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
    name = next(n for n, m in drafting_methods().items() if not m.capabilities.trees and m.draft)
    with pytest.raises(SystemExit) as stop:
        benchmark.main(["--target", "/nonexistent", "--questions", "/nonexistent.jsonl", "--out", "/nonexistent-out",
                        "--method", name, "--draft", "/nonexistent-head", "--tree"])
    assert stop.value.code == 2
    assert f"--tree: --method {name} cannot draft a dynamic tree" in capsys.readouterr().err


PROMPTS = [torch.tensor([[1, 5, 9, 14, 3, 7]]), torch.tensor([[2, 8, 4]])]


@pytest.mark.slow  # about 45 s for the catalog: with CI's slow tests, out of the default suite's ten minutes
@pytest.mark.parametrize("name", sorted(HEADS))
def test_every_head_decodes_greedy_exact_in_every_shape_it_declares(name, target_dir):
    """A random head on a tiny target: chains always; dynamic and static trees, batches and sampled q exactly where
    its drafter declares them. Random drafts are mostly rejected, so exactness is what this checks."""
    target = target_for(target_dir)
    head = tiny_head(name, target).eval()
    can = HEADS[name].capabilities
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

    def begun(threshold: float = 0.0) -> Drafter:
        drafter = drafter_for(head, 64)
        drafter.confidence_threshold = threshold
        if can.self_verify:
            drafter.attach(runner)
        drafter.begin(PROMPTS[0], runner_states(runner, PROMPTS[0]), 0)
        return drafter

    _, q = begun().propose_sampled(3, Sampling(0.8), torch.Generator().manual_seed(0))
    assert (q is not None) == can.sampled, name  # sampled drafts carry their q; the others are one-hot (None)
    if can.confidence:  # no draft has probability above 1: every chain stops after its first draft, output unchanged
        assert len(begun().propose(3)) > 1, name
        assert len(begun(1.01).propose(3)) == 1, name
        unsure = with_threshold(lambda: drafter_for(head, 64), 0.5)
        got = speculative_generate(runner, unsure(), PROMPTS[0], n, set(), k=3)
        assert got.tokens == plain_generate(runner, PROMPTS[0], n, set()).tokens, name
    if can.batches:
        ragged = RaggedRunner(target, max_len=64, with_aux=can.reads_aux)
        plain, _ = batch_plain_generate(ragged, PROMPTS, n, set())
        outs, _ = batch_speculative_generate(ragged, drafter_for(head, 64), PROMPTS, n, set(), k=3)
        assert [o.tokens for o in outs] == [o.tokens for o in plain], name
        outs, _ = batch_speculative_generate(ragged, PerSequence([drafter_for(head, 64) for _ in PROMPTS]), PROMPTS, n,
                                             set(), k=3)
        assert [o.tokens for o in outs] == [o.tokens for o in plain], name


@pytest.fixture(scope="module")
def world_on_disk(world, tmp_path_factory):
    """The 8-token target, saved: a builder may read the target's checkpoint (the draft model cuts its config)."""
    model, shared, head = world
    directory = tmp_path_factory.mktemp("world")
    model.save_pretrained(directory)
    shared.target.path = str(directory)
    return model, shared, head


SHAPES = {None: None, "block": None, "dynamic": DynamicTree(depth=3, topk=3, total_tokens=8),
          "static": StaticTree(((0,), (1,), (0, 0), (1, 0), (0, 0, 0)))}
"""A chain (verified token by token, or as a block), and each tree kind a drafter can declare."""


@pytest.mark.nightly  # 2,500 sampled requests a head and shape
@pytest.mark.parametrize(("name", "shape"), [(n, kind) for n in sorted(HEADS)
                                             for kind in (None, "block", *HEADS[n].capabilities.trees)
                                             + (("confidence",) if HEADS[n].capabilities.confidence else ())])
def test_sampling_keeps_the_target_distribution_in_every_declared_shape(name, shape, world_on_disk):
    """Lossless sampling, by the shipped chi-square test (tests/test_sampling_loop.py): a random head of every entry,
    verified by rejection sampling in a chain (token by token, and as a block), in every tree kind it declares and, where
    it declares a confidence rule, in chains that rule cuts (threshold 0.5), emits the target's own joint distribution
    (its drafts drawn from q where it declares sampled drafts, one-hot q otherwise)."""
    model, shared, _ = world_on_disk
    spec = HEADS[name]
    runner = TargetRunner(shared.target, max_len=32, with_aux=spec.capabilities.reads_aux)
    # The 8-token target of the test: a draft vocab no larger than its vocab.
    options = spec.options(**{k: min(v, V) if k == "draft_vocab_size" else v for k, v in spec.tiny.items()})
    torch.manual_seed(3)
    head = build_head(DraftConfig(head=name, options=options), runner.target, torch.ones(V))
    perturb(head, 0.3)
    make = with_threshold(lambda: drafter_for(head.eval(), 32), 0.5 if shape == "confidence" else 0.0)
    pairs = sample_pairs(runner, make, 2500, seed=0, tree=SHAPES.get(shape),
                         verification=Verification("block" if shape == "block" else "token"))
    stat, critical = chi2_vs(pairs, exact_joint(model))
    assert stat < critical


def runner_states(runner: TargetRunner, prompt: torch.Tensor):
    """The target's states over ``prompt``, as the loop hands them to ``begin``."""
    runner.reset()
    _, states = runner.forward(prompt)
    runner.commit(prompt.shape[1])
    return states
