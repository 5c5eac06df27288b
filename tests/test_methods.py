"""One catalog of drafting methods (decode/methods.py and heads/methods.py): every head and every other method is
built through it, a method added to it alone runs in ``headstart bench``, and the flags a method cannot take are
refused by what its entry says it can do, not by its name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from headstart.decode import methods as decode_methods
from headstart.decode.methods import Drafting, DraftingMethod
from headstart.decode.ngram import NgramDrafter
from headstart.heads.methods import drafting_methods
from headstart.heads.registry import HEADS
from headstart.scripts import benchmark

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo"


def test_the_catalog_holds_every_head_then_every_other_method():
    own = [name for name, spec in HEADS.items() if spec.decoded_by is None]
    assert list(drafting_methods()) == [*own, *decode_methods.METHODS]
    for name, spec in HEADS.items():  # a head decoded by another method names one that takes a --draft directory
        if spec.decoded_by is not None:
            assert spec.decoded_by in decode_methods.METHODS and decode_methods.METHODS[spec.decoded_by].draft, name
    for name in own:
        spec, m = HEADS[name], drafting_methods()[name]
        assert m.draft and not m.own_loop and m.capabilities == spec.drafter.capabilities
        # what decoding reads: what the head trains on, but for a self-speculative drafter (early exit runs the layers
        # it trained on, so the runner builds no aux states)
        can = m.capabilities
        assert can.reads_aux == (spec.cls.needs.aux_hidden_states and not can.self_verify), name
    assert drafting_methods()["eagle3"].capabilities.reads_aux and not drafting_methods()["early-exit"].capabilities.reads_aux


def parse(*flags: str):
    p = benchmark.build_parser()
    return p, p.parse_args(["--target", "t", "--questions", "q", "--out", "o", *flags])


@pytest.mark.parametrize("flags, error", [
    (["--method", "ngram", "--confidence-threshold", "0.5"], "--confidence-threshold: --method ngram has no draft probabilities"),
    (["--method", "hf-prompt-lookup", "--tree"], "--tree: --method hf-prompt-lookup cannot draft a dynamic tree (its drafter "
                                                 "drafts chains only)"),
    (["--method", "ngram", "--tree-paths", "paths.json"], "--tree-paths: --method ngram cannot draft a static tree of rank "
                                                          "paths (its drafter drafts dynamic trees)"),
    (["--method", "ngram", "--hybrid-ngram", "1"], "--hybrid-ngram: n-gram lookup cannot take the rounds of --method ngram"),
    (["--method", "early-exit", "--draft", "d", "--tree"], "--tree: --method early-exit cannot draft a dynamic tree"),
    (["--method", "early-exit", "--draft", "d", "--batch-size", "2"], "--batch-size 2: --method early-exit decodes one "
                                                                      "sequence at a time (it drafts on the target's own cache)"),
    (["--method", "early-exit", "--draft", "d", "--hybrid-ngram", "1"], "--hybrid-ngram: n-gram lookup cannot take the "
                                                                        "rounds of --method early-exit, which verifies"),
    (["--method", "draft-model"], "--method draft-model needs --draft (an HF causal LM directory)"),
    (["--method", "eagle3"], "--method eagle3 needs --draft (the head's exported directory)"),
    (["--method", "hf-assisted", "--draft", "d", "--compile"], "--compile runs headstart's loops"),
])
def test_flags_a_method_cannot_take_are_refused_by_name(flags, error, capsys):
    p, args = parse(*flags)
    with pytest.raises(SystemExit):
        benchmark.check_args(p, args)
    assert error in capsys.readouterr().err


def toy(ctx) -> Drafting:
    """A method the catalog did not have: n-gram lookup of single tokens."""
    return Drafting(lambda: NgramDrafter(1))


def test_a_method_added_to_the_catalog_alone_is_run_and_refused_by_its_fields(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(decode_methods.METHODS, "toy", DraftingMethod("single-token lookup", toy, NgramDrafter.capabilities))
    p, args = parse("--method", "toy", "--confidence-threshold", "0.5")
    with pytest.raises(SystemExit):  # n-gram lookup's capabilities: no probabilities to stop a chain on
        benchmark.check_args(p, args)
    assert "--confidence-threshold: --method toy has no draft probabilities" in capsys.readouterr().err
    out = tmp_path / "toy"
    assert benchmark.main(["--target", str(DEMO / "target"), "--method", "toy", "--questions",
                           str(DEMO / "eval" / "mt_bench.jsonl"), "--limit", "1", "--max-new-tokens", "24",
                           "--num-speculative-tokens", "3", "--no-hf-reference", "--verify-greedy", "--out", str(out)]) == 0
    report = json.loads((out / "results.json").read_text())
    assert report["args"]["method"] == "toy" and report["mismatches"] == []
    overall = report["results"]["overall"]
    assert overall["tau"] >= 1.0 and len(overall["acceptance_by_position"]) == 3
