"""The head contract: one registry entry names every part of a head, and the shared code reads heads only
through it -- builds, exports, detection, the drafter and the card agree for every registered head."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import subprocess
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_causal_lm

from headstart.heads.exports import convert_head, detect_layout
from headstart.models.export import export_head
from headstart.models.head import DraftConfig, DraftHead
from headstart.models.provenance import OtherTargetError, fingerprint
from headstart.heads.registry import HEADS, SHARED_FIELDS, build_head, drafter_for, load_head, spec_of
from headstart.models.target import Target, TargetConfig

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    tiny_causal_lm("llama", num_hidden_layers=8, head_dim=8).save_pretrained(root)
    return root


AUX_LAYERS = {"early-exit": (4,)}
"""The target's capture a head needs when it is not the default three layers (early exit reads one: its exit layer)."""


def target_for(name: str, target_dir) -> Target:
    return Target.from_pretrained(TargetConfig(path=str(target_dir), dtype="float32", aux_layer_ids=AUX_LAYERS.get(name)))


def test_every_entry_is_complete_and_its_fields_are_its_own():
    for name, spec in HEADS.items():
        own = {f.name for f in dataclasses.fields(spec.options)}
        assert own and not own & set(SHARED_FIELDS), name  # no head redefines a shared field
        assert spec.cards and spec.title and spec.unit, name
        assert isinstance(spec.cls.needs.aux_hidden_states, bool), name


@pytest.mark.parametrize("name", sorted(HEADS))
def test_each_head_builds_exports_is_detected_loads_and_decodes_through_its_entry(name, target_dir, tmp_path):
    target = target_for(name, target_dir)
    counts = torch.arange(target.config.vocab_size, dtype=torch.float32)
    spec = HEADS[name]
    small = {"draft_vocab_size": 48} if "draft_vocab_size" in {f.name for f in dataclasses.fields(spec.options)} else {}
    head = build_head(DraftConfig(head=name, options=spec.options(**small)), target, counts)
    assert isinstance(head, DraftHead) and spec_of(head) is spec
    # train.compile's parts: each a module, a list of modules or a method of this head (models/train_compile.py)
    for path in type(head).compiled:
        part = functools.reduce(getattr, path.split("."), head)
        assert isinstance(part, torch.nn.Module) or inspect.ismethod(part), (name, path)
    export_head(head, tmp_path / "out", name, fingerprint(target_dir))
    layout = head.layouts[0]
    assert layout in spec.cards  # every layout a head writes has a card
    assert detect_layout(tmp_path / "out") == (name, layout)  # its own detector claims it, no other one does
    loaded = load_head(name, str(tmp_path / "out"), target)
    assert type(loaded) is spec.cls
    drafter = drafter_for(loaded, 64)
    assert all(callable(getattr(drafter, m, None)) for m in ("begin", "propose", "update"))
    compiled = drafter_for(loaded, 64, compile=True)  # the contract's compiled drafter (compiles when first run:
    assert callable(getattr(compiled, "precompile", None))  # tests/test_compiled_decode.py runs each kind)


@pytest.mark.parametrize("name", sorted(HEADS))
def test_a_head_started_from_a_published_one_has_its_weights_and_vocab(name, target_dir, tmp_path):
    target = target_for(name, target_dir)
    spec = HEADS[name]
    sized = "draft_vocab_size" in {f.name for f in dataclasses.fields(spec.options)}
    options = spec.options(**({"draft_vocab_size": 48} if sized else {}))
    torch.manual_seed(1)
    published = build_head(DraftConfig(head=name, options=options), target,
                           torch.arange(target.config.vocab_size, dtype=torch.float32))
    with torch.no_grad():  # trained: away from any deterministic start (an identity adapter, the target's own layers)
        for p in published.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    export_head(published, tmp_path / "pub", name, fingerprint(target_dir))
    want = load_head(name, str(tmp_path / "pub"), target).state_dict()
    # Other token counts and seed: a fresh head would differ in every weight and (with a draft vocab) in its map.
    torch.manual_seed(2)
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
    if sized:  # another shape is refused, naming the tensors
        with pytest.raises(ValueError, match=r"does not fit this recipe's .* head[\s\S]*\(48, .*there"):
            build_head(DraftConfig(head=name, options=spec.options(draft_vocab_size=32), init_from=str(tmp_path / "pub")),
                       target, counts)


def test_converting_a_head_with_one_layout_is_refused_by_name(target_dir, tmp_path):
    target = Target.from_pretrained(TargetConfig(path=str(target_dir), dtype="float32"))
    head = build_head(DraftConfig(head="medusa", options=HEADS["medusa"].options(num_heads=2)), target,
                      torch.ones(target.config.vocab_size))
    export_head(head, tmp_path / "m", "medusa", fingerprint(target_dir))
    with pytest.raises(ValueError, match=r"holds medusa \(vllm layout\); medusa heads are exported in \['vllm'\], "
                                         r"not 'flat'"):
        convert_head(tmp_path / "m", tmp_path / "out", "flat")


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
    assert not re.search(r"\b(Eagle3Draft|MedusaHeads|MTPHead)\b", subprocess.run(
        ["cat", *map(str, shared)], capture_output=True, text=True).stdout)
