"""The CLIs as a user runs them, and the committed demo artifacts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CHATML_TEMPLATE, make_tokenizer

REPO = Path(__file__).resolve().parents[1]
DEMO_TARGET = REPO / "configs" / "demo" / "target"


def run_script(name: str, *args: str, env_cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HEADSTART_CACHE": str(env_cache)}
    return subprocess.run([sys.executable, str(REPO / "scripts" / name), *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_prepare_data_cli_summary_show_and_errors(tmp_path):
    make_tokenizer(CHATML_TEMPLATE, "<|im_end|>").save_pretrained(tmp_path / "tok")
    rows = [{"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello there."}]},
            {"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}]
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    common = ["--data", str(data), "--tokenizer", str(tmp_path / "tok"), "--output", str(tmp_path / "out")]

    failed = run_script("prepare_data.py", *common, env_cache=tmp_path / "cache")
    assert failed.returncode == 2
    assert "chat.jsonl row 1: turn 1 has unknown role 'bot'" in failed.stderr

    ok = run_script("prepare_data.py", *common, "--skip-bad-rows", "--show", "1", env_cache=tmp_path / "cache")
    assert ok.returncode == 0, ok.stderr
    assert "rows skipped                1" in ok.stdout
    assert "[[Hello there.<|im_end|>]]" in ok.stdout  # the trained span, highlighted
    assert "[[Hi?" not in ok.stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["rows_kept"] == 1 and summary["rows_read"] == 2


def test_demo_target_is_a_complete_hf_chat_checkpoint():
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(DEMO_TARGET)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET)
    generation = GenerationConfig.from_pretrained(DEMO_TARGET)
    assert config.model_type == "llama" and config.num_hidden_layers >= 8
    assert config.max_position_embeddings >= 4096
    assert generation.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert (DEMO_TARGET / "model.safetensors").stat().st_size <= 25 * 2**20
    card = (DEMO_TARGET / "README.md").read_text()
    stats = json.loads((DEMO_TARGET / "training_stats.json").read_text())
    assert f"{stats['held_out_loss']:.4f}" in card and "benchmarks/train_demo_target.py" in card


@pytest.mark.nightly
def test_demo_target_continues_a_chat_sensibly():
    """The demo target ends an answer with its end-of-turn token within a few dozen tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET)
    model = AutoModelForCausalLM.from_pretrained(DEMO_TARGET, dtype=torch.float32)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 15 plus 27?"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=80, do_sample=False)[0, ids.shape[1]:]
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in out.tolist()


@pytest.mark.slow  # 29 s here: with CI's slow tests, out of the default suite's ten minutes
def test_bench_train_runs_and_reports_the_step_cost(tmp_path):
    """benchmarks/bench_train.py broke silently once (a changed BatchPlan call); run it for real on a tiny setup."""
    from trainer_fixtures import make_setup

    overrides = make_setup(tmp_path)
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_train.py"), "--config", str(REPO / "configs/demo/eagle3.yaml"),
                           "--steps", "2", "--warmup", "1", "--layouts", "padded", "packed", "--deal", "cost", "stream",
                           "--out", str(tmp_path / "B.md"), *overrides], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (tmp_path / "B.md").read_text()
    assert ("| tokens/s (all ranks) | layout | rows dealt | head parts compiled | step time | target forward alone | "
            "step / target forward | slots / token |") in table
    rows = {(r.split("|")[2].strip(), r.split("|")[3].strip()): r.split("|") for r in table.splitlines()
            if r.startswith("| ") and "ms |" in r}
    assert set(rows) == {("padded", "stream"), ("packed", "by cost"), ("packed", "stream")}  # padded is never dealt
    for row in rows.values():
        assert float(row[1].replace(",", "")) > 0 and row[4].strip() == "no"
        assert row[7].strip().endswith("x") and float(row[8]) >= 1.0
    # Packing never adds padding: at most the padded layout's slots per token.
    assert float(rows["packed", "by cost"][8]) <= float(rows["padded", "stream"][8])
    assert "packed (by cost) / padded tokens/s:" in table and "packed, by cost / stream tokens/s:" in table
    # train.compile measured against eager in the same run: a row each, and their ratio.
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_train.py"), "--config", str(REPO / "configs/demo/eagle3.yaml"),
                           "--steps", "2", "--warmup", "1", "--layouts", "packed", "--compile", "off", "on",
                           "--out", str(tmp_path / "C.md"), *overrides], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (tmp_path / "C.md").read_text()
    compiled = sorted(r.split("|")[4].strip() for r in table.splitlines() if r.startswith("| ") and "ms |" in r)
    assert compiled == ["no", "yes"] and "packed (by cost), compiled / eager tokens/s: **" in table


def test_bench_train_times_a_warm_target_forward(tmp_path, monkeypatch):
    """A batch's first forward paying for its new shapes (a GPU's allocator) is not the forward's cost: a stand-in
    whose first call per batch costs 0.3 s more must not show in the "target forward alone" time."""
    from trainer_fixtures import make_setup

    from headstart.benchmarks import bench_train
    from headstart.trainer.config import load_config

    real, seen = bench_train.target_forward, set()

    def first_call_costs(trainer, batches):
        if id(batches) not in seen:
            seen.add(id(batches))
            time.sleep(0.3)
        real(trainer, batches)

    monkeypatch.setattr(bench_train, "target_forward", first_call_costs)
    result = bench_train.measure(load_config(None, make_setup(tmp_path)), steps=2, warmup=0)
    assert len(seen) == 2  # it really ran once per step's batches
    assert result["fwd"] < 0.2, result


def test_profile_step_splits_a_step_into_its_parts(tmp_path):
    """benchmarks/profile_step.py on a tiny setup: every part of the step is timed, the heads' scopes nest in the
    forward, and the op table lists real ops."""
    from trainer_fixtures import make_setup

    overrides = make_setup(tmp_path)
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "profile_step.py"), "--config", str(REPO / "configs/demo/eagle3.yaml"),
                           "--steps", "1", "--flop-steps", "3", "--out", str(tmp_path / "B.md"), *overrides],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (tmp_path / "B.md").read_text()
    parts = {r.split("|")[1].strip().replace("&nbsp;", "").split(" (within")[0]: float(r.split("|")[2])
             for r in text.splitlines() if r.startswith("| ") and r.split("|")[2].strip().replace(".", "").isdigit()}
    for scope in ("step: data", "step: features", "step: head forward", "head: draft step", "head: vocab loss",
                  "step: head backward", "step: optimizer"):
        assert scope in parts, (scope, parts)
    assert parts["step: head forward"] > 0 and parts["step: head backward"] > 0
    assert parts["head: draft step"] + parts["head: vocab loss"] <= parts["step: head forward"] * 1.01
    assert "| `aten::" in text  # the op table
    step, forward, ratio, median, low, high = re.search(
        r"FLOPs of 3 steps .*\(matrix products\): ([\d,.]+) / ([\d,.]+) GFLOP = \*\*([\d.]+)x\*\* "
        r"\(a step's own: median ([\d.]+)x, ([\d.]+)x-([\d.]+)x\)", text).groups()
    step, forward = float(step.replace(",", "")), float(forward.replace(",", ""))
    # the step holds the target's forward (less its lm_head off the trained positions) and the head's forward + backward
    assert 1.0 < float(ratio) < 50 and float(ratio) == pytest.approx(step / forward, rel=0.02)
    assert float(low) <= float(median) <= float(high) and float(low) - 0.01 <= float(ratio) <= float(high) + 0.01


def test_profile_step_runs_from_stored_features(tmp_path):
    """An offline run has no target in the process: its step is profiled, the FLOP comparison left out (it crashed)."""
    from trainer_fixtures import make_setup

    from headstart.scripts import generate_features
    from headstart.trainer.config import load_config

    store = tmp_path / "store"
    overrides = make_setup(tmp_path) + [f"--features.path={store}"]
    generate_features.generate(load_config(None, overrides))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "profile_step.py"), "--config", str(REPO / "configs/demo/eagle3.yaml"),
                           "--steps", "1", "--out", str(tmp_path / "B.md"), *overrides],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (tmp_path / "B.md").read_text()
    assert "Offline eagle3 training" in text and "| step: head backward |" in text and "FLOPs of" not in text


def test_heldout_tau_runs_any_head_and_counts_like_the_decoder(tmp_path):
    """benchmarks/heldout_tau.py on a just-trained tiny Medusa head: tau = tokens / forwards of the real decoder."""
    import re

    from trainer_fixtures import make_setup

    from headstart.trainer.config import load_config
    from headstart.trainer.run import build_trainer

    overrides = make_setup(tmp_path, head="medusa") + ["--train.max_steps=2", "--draft.num_heads=2"]
    build_trainer(load_config(None, overrides)).train()
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "heldout_tau.py"), "--heads", str(tmp_path / "run" / "final"),
                           "--prompts", "2", "--max-new-tokens", "8", "--k", "2", *overrides],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = re.search(r"(\d+) held-out prompts, tau ([\d.]+) \((\d+) tokens / (\d+) forwards\)", proc.stdout)
    prompts, tau, tokens, forwards = int(line[1]), float(line[2]), int(line[3]), int(line[4])
    assert prompts == 2 and tau == pytest.approx(tokens / forwards, abs=1e-3) and 1.0 <= tau <= 3.0
    assert tokens >= 2 * 7  # 8 new tokens per prompt, the prefill's own token not counted (an EOS may end one early)


def test_benchmark_script_runs_headstart_and_transformers_peers_and_writes_the_split(tmp_path):
    """scripts/benchmark.py end to end on the demo target: n-gram (headstart's loop: a per-round split and a
    predicted speed-up) and transformers' prompt lookup (its own loop: tau and speed-up only), greedy-exact."""
    for method in ("ngram", "hf-prompt-lookup"):
        out = tmp_path / method
        proc = subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark.py"), "--target", str(REPO / "configs/demo/target"),
                               "--method", method, "--questions", str(REPO / "configs/demo/eval/mt_bench.jsonl"), "--limit", "1",
                               "--max-new-tokens", "16", "--no-hf-reference", "--verify-greedy", "--out", str(out)],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        report = json.loads((out / "results.json").read_text())
        assert report["speedup"] > 0 and report["results"]["overall"]["tau"] >= 1.0
        # where the numbers came from: the command as run, the code's commit, the machine, the time (UTC)
        assert report["command"].startswith("python ") and f"--method {method}" in report["command"]
        assert re.fullmatch(r"[0-9a-f]{12}(-dirty)?", report["commit"]) and report["machine"].startswith(("CPU", "NVIDIA"))
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", report["date"])
        if method == "ngram":
            assert report["predicted_speedup"] > 0 and "target verify" in (out / "results.md").read_text()
        else:
            assert report["predicted_speedup"] is None


@pytest.mark.slow  # 39 s here: with CI's slow tests, out of the default suite's ten minutes
def test_generate_answers_a_prompt_with_a_head_and_compares_with_plain_decoding(tmp_path):
    """`headstart generate`: the demo EAGLE-3 head answers a prompt from a file through the chat template; the reply
    is the target's own greedy reply (the same tokens as plain decoding, which --compare checks), its numbers go to
    stderr (the demo head accepts several drafts a round). An empty prompt and a missing one are refused by name."""
    from headstart.decode.questions import prompt_ids
    from headstart.decode.generate import greedy_generate
    from headstart.decode.target_runner import TargetRunner
    from headstart.models.target import Target, TargetConfig, load_tokenizer

    question = "Natalia sold clips to 48 of her friends in April. How many clips did she sell?"
    (tmp_path / "q.txt").write_text(question)
    cli = [sys.executable, "-m", "headstart.scripts.cli", "generate", "--target", str(DEMO_TARGET)]
    head = ["--method", "eagle3", "--draft", str(REPO / "configs/demo/eagle3-head"), "--max-new-tokens", "40"]
    proc = subprocess.run([*cli, *head, "--prompt-file", str(tmp_path / "q.txt"), "--compare"], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    tokenizer = load_tokenizer(str(DEMO_TARGET))
    ids = prompt_ids(tokenizer, [{"role": "user", "content": question}])
    # what generate runs on a CPU: float32 (TargetConfig's default is bfloat16, whose near-ties pick other tokens on
    # another torch build) and a cache of the target's context length
    target = Target.from_pretrained(TargetConfig(path=str(DEMO_TARGET), dtype="float32"))
    runner = TargetRunner(target, max_len=target.context_length)
    want = tokenizer.decode(greedy_generate(runner, ids, 40, {tokenizer.eos_token_id}).tokens, skip_special_tokens=True)
    assert proc.stdout == want + "\n"
    tau = float(re.search(r"eagle3: \d+ tokens in [\d.]+ s \([\d.]+ tokens/s\), tau ([\d.]+)", proc.stderr).group(1))
    assert tau > 2.0 and "the same tokens as plain greedy decoding" in proc.stderr
    assert re.search(r"plain decoding: \d+ tokens, [\d.]+ tokens/s: speed-up [\d.]+x", proc.stderr)
    empty = subprocess.run([*cli, *head, "--prompt", "  "], capture_output=True, text=True, timeout=600)
    assert empty.returncode == 2 and "the prompt is empty" in empty.stderr
    absent = subprocess.run([*cli, *head, "--prompt-file", str(tmp_path / "nope.txt")], capture_output=True, text=True,
                            timeout=600)
    assert absent.returncode == 2 and f"--prompt-file {tmp_path / 'nope.txt'}: no such file" in absent.stderr
    missing = subprocess.run([*cli, *head], capture_output=True, text=True, timeout=600)
    assert missing.returncode == 2 and "one of the arguments --prompt --prompt-file is required" in missing.stderr


def test_benchmark_script_stops_unsure_chains_on_tuned_blocks_and_refuses_the_rule_where_it_has_no_meaning(tmp_path):
    """``--confidence-threshold`` with ``--tune-blocks`` end to end: greedy-exact, the run records both and its section
    says them; n-gram lookup (no probabilities) is refused by name."""
    bench = [sys.executable, str(REPO / "scripts" / "benchmark.py"), "--target", str(REPO / "configs/demo/target"),
             "--questions", str(REPO / "configs/demo/eval/mt_bench.jsonl"), "--limit", "1", "--max-new-tokens", "24",
             "--no-hf-reference", "--verify-greedy"]
    out = tmp_path / "mtp"
    proc = subprocess.run(bench + ["--method", "mtp", "--draft", str(REPO / "configs/demo/mtp-head"), "--confidence-threshold",
                                   "0.6", "--tune-blocks", "--out", str(out), "--benchmarks", str(tmp_path / "B.md")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "results.json").read_text())
    assert report["mismatches"] == [] and report["args"]["confidence_threshold"] == 0.6
    assert "blocks of n tokens run at: 1 -> " in proc.stderr  # stderr: generate keeps stdout for the reply
    assert "greedy, stop under p 0.6, blocks padded" in (tmp_path / "B.md").read_text()
    refused = subprocess.run(bench + ["--method", "ngram", "--confidence-threshold", "0.4", "--out", str(tmp_path / "n")],
                             capture_output=True, text=True, timeout=600)
    assert refused.returncode != 0 and "--confidence-threshold: --method ngram has no draft probabilities" in refused.stderr


@pytest.mark.nightly
def test_benchmark_script_compiles_a_batch(tmp_path):
    """``--compile --batch-size 2``: the batch's target forward and EAGLE-3's batched layer compiled (inductor), greedy
    outputs equal plain greedy decoding, and the section says what ran compiled."""
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark.py"), "--target", str(REPO / "configs/demo/target"),
                           "--method", "eagle3", "--draft", str(REPO / "configs/demo/eagle3-head"), "--questions",
                           str(REPO / "configs/demo/eval/mt_bench.jsonl"), "--limit", "2", "--max-new-tokens", "16",
                           "--max-len", "256", "--num-speculative-tokens", "3", "--batch-size", "2", "--compile",
                           "--no-hf-reference", "--verify-greedy", "--out", str(out), "--benchmarks", str(tmp_path / "B.md")],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    assert report["mismatches"] == [] and report["results"]["overall"]["tau"] > 1.0 and report["speedup"] > 0
    assert "greedy, batch 2, compiled target and drafter" in (tmp_path / "B.md").read_text()
