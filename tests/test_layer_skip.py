"""Draft & Verify (decode/layer_skip.py): the target drafting with layers left out on its own KV cache, greedy-exact
and lossless through the loop; a layer that does nothing, skipped, drafts what the target says (so the drafts read the
cache right); the search finds such layers; bad skip sets refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from headstart.decode.generate import plain_generate, speculative_generate
from headstart.decode.layer_skip import LayerSkipDrafter, layer_skip_search, parse_skip
from headstart.decode.target_runner import TargetRunner
from headstart.models.target import Target

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [torch.tensor([[1, 5, 9, 14, 3, 7]]), torch.tensor([[2, 8, 4, 4]])]


def test_a_skip_list_is_read_and_bad_ones_refused_by_name():
    assert parse_skip("3,5,7-9", 12) == {3, 5, 7, 8, 9}
    with pytest.raises(ValueError, match="names no layer"):
        parse_skip(" , ", 12)
    with pytest.raises(ValueError, match=r"layers 0..11, not \[12\]"):
        parse_skip("2,12", 12)
    with pytest.raises(ValueError, match="every one of the target's 4 layers skipped"):
        parse_skip("0-3", 4)
    with pytest.raises(ValueError, match="comma-separated layer indices"):
        parse_skip("3;4", 12)


@pytest.fixture(scope="module")
def tiny():
    """A tiny target whose layers 2 and 5 add nothing to the residual stream (their output projections zeroed)."""
    from tiny_models import tiny_causal_lm

    model = tiny_causal_lm("llama", num_hidden_layers=8, vocab_size=32)
    with torch.no_grad():
        for i in (2, 5):
            layer = model.model.layers[i]
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model, TargetRunner(Target(model, capture_aux=False), max_len=96, with_aux=False)


def test_skipping_nothing_is_the_full_forward_and_skipping_an_idle_layer_changes_nothing(tiny):
    model, runner = tiny
    ids = PROMPTS[0]
    target = runner.target
    full = model(ids).logits
    assert torch.allclose(target.logits(target.skipping_layers(ids, frozenset(), None, None)), full, atol=1e-5)
    assert torch.allclose(target.logits(target.skipping_layers(ids, frozenset({2, 5}), None, None)), full, atol=1e-5)
    assert not torch.allclose(target.logits(target.skipping_layers(ids, frozenset({3}), None, None)), full, atol=1e-3)


def test_layer_skip_is_greedy_exact_and_an_idle_layer_skipped_drafts_the_target(tiny):
    _, runner = tiny
    for prompt in PROMPTS:
        plain = plain_generate(runner, prompt, 40, set()).tokens
        idle = speculative_generate(runner, LayerSkipDrafter(frozenset({2, 5})), prompt, 40, set(), k=4)
        assert idle.tokens == plain and idle.tau > 4.5  # every draft accepted but where the budget cuts a round
        lossy = speculative_generate(runner, LayerSkipDrafter(frozenset({1, 3, 4, 6})), prompt, 40, set(), k=4)
        assert lossy.tokens == plain and lossy.tau < idle.tau


def test_the_search_finds_the_layers_that_do_nothing(tiny):
    _, runner = tiny
    found = layer_skip_search(runner.target, PROMPTS, 2)
    assert found["skip_layers"] == [2, 5] and found["agreement"] == 1.0
    assert found["forwards"] == 1 + 8 + 7 and found["tokens"] == 10 and found["seconds"] >= 0
    assert found["alone"]["2"] == found["alone"]["5"] == 1.0 and min(found["alone"].values()) < 1.0
    narrow = layer_skip_search(runner.target, PROMPTS, 3, candidates=2)
    assert narrow["forwards"] == 1 + 8 + 2 + 2 and narrow["skip_layers"][:2] == [2, 5]
    with pytest.raises(ValueError, match="skip between 1 and 7"):
        layer_skip_search(runner.target, PROMPTS, 8)


def test_bench_refuses_layer_skip_without_a_set_and_the_flag_elsewhere(capsys):
    from headstart.scripts import benchmark

    base = ["--target", "/nonexistent", "--questions", "/nonexistent.jsonl", "--out", "/nonexistent-out"]
    for flags, said in ((["--method", "layer-skip"], "--method layer-skip needs --skip-layers"),
                        (["--method", "ngram", "--skip-layers", "3"], "--skip-layers is another method's flag"),
                        (["--method", "layer-skip", "--skip-layers", "3", "--tree"], "--tree: --method layer-skip"),
                        (["--method", "layer-skip", "--skip-layers", "3", "--batch-size", "2"], "--batch-size 2"),
                        (["--method", "layer-skip", "--skip-layers", "3", "--compile"], "--compile: --method layer-skip"),
                        (["--method", "early-exit", "--draft", "d", "--compile"], "--compile: --method early-exit")):
        with pytest.raises(SystemExit) as stop:
            benchmark.main([*base, *flags])
        assert stop.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.slow  # 2,500 sampled requests: about 40 s
def test_layer_skip_samples_follow_the_target():
    """Lossless sampling by the shipped chi-square test: drafts drawn from the skipping model's q."""
    from test_sampling_loop import chi2_vs, exact_joint, sample_pairs
    from tiny_models import tiny_causal_lm

    model = tiny_causal_lm("llama", num_hidden_layers=8, vocab_size=8)
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)  # the world of tests/test_sampling_loop.py
    runner = TargetRunner(Target(model, capture_aux=False), max_len=32, with_aux=False)
    pairs = sample_pairs(runner, lambda: LayerSkipDrafter(frozenset({1, 4, 6})), 2500, seed=0)
    stat, critical = chi2_vs(pairs, exact_joint(model))
    assert stat < critical


@pytest.mark.slow  # the demo target: about 20 s
def test_headstart_layer_skip_writes_a_set_bench_decodes_with(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "skip.json"
    run = subprocess.run([sys.executable, "-m", "headstart.scripts.cli", "layer-skip", "--config", "configs/demo/eagle3.yaml",
                          "--data", "configs/demo/data/gsm8k_train.jsonl[0:4]", "--max-tokens", "64", "--skip", "2",
                          "--output", str(out)], cwd=REPO, capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    found = json.loads(out.read_text())
    assert len(found["skip_layers"]) == 2 and 0 <= found["agreement"] <= 1 and found["conversations"] == 4
    again = subprocess.run([sys.executable, "-m", "headstart.scripts.cli", "layer-skip", "--config", "configs/demo/eagle3.yaml",
                            "--skip", "2", "--output", str(out)], cwd=REPO, capture_output=True, text=True, env=env)
    assert again.returncode == 2 and "--overwrite" in again.stderr  # a finished search is never overwritten unasked
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "math", "turns": ["What is 12 + 30?"]}) + "\n")
    bench = subprocess.run([sys.executable, "-m", "headstart.scripts.cli", "bench", "--target", "configs/demo/target",
                            "--questions", str(questions), "--method", "layer-skip", "--skip-layers", found["skip_arg"],
                            "--max-new-tokens", "24", "--verify-greedy", "--no-hf-reference", "--out", str(tmp_path / "b")],
                           cwd=REPO, capture_output=True, text=True, env=env)
    assert bench.returncode == 0, bench.stderr
    assert json.loads((tmp_path / "b" / "results.json").read_text())["results"]["overall"]["tau"] >= 1.0
