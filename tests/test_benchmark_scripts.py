"""The lab scripts in benchmarks/, each run for real, end to end, on the smallest setup that exercises it.

These scripts are run by hand and rarely; without a test a refactor breaks them silently (bench_train.py
crashed for weeks). Each test runs the script as a user does (a subprocess, in a temporary directory) and
checks the table or section it writes. Nothing here downloads anything: the targets are the committed demo
target or a tiny random one written by ``trainer_fixtures.make_setup``.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEMO_TARGET = REPO / "configs" / "demo" / "target"
DEMO_CONFIG = REPO / "configs" / "demo" / "eagle3.yaml"
OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1"}


def run(script: str, *args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *map(str, args)], cwd=cwd, env=OFFLINE,
                          capture_output=True, text=True, timeout=600)
    assert not check or proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc


def table_rows(text: str, header: str) -> list[list[str]]:
    """The cells of the markdown table under ``header`` (which must be in ``text``), one list per row."""
    assert header in text, text[-3000:]
    lines = text[text.index(header):].splitlines()
    assert set(lines[1]) <= set("|-"), lines[1]  # the separator row
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    assert rows and all(len(r) == header.count("|") - 1 for r in rows), rows
    return rows


def section(path: Path, title: str) -> str:
    """The body of the section ``## title`` that append_section wrote to ``path``."""
    text = path.read_text()
    assert text.startswith("# Benchmarks") and f"\n## {title}\n" in text, text[:2000]
    return text.split(f"\n## {title}\n", 1)[1]


@pytest.mark.nightly  # a lab script run by hand, so with the nightly tests
def test_ablate_recipe_trains_each_variant_and_measures_its_head(tmp_path):
    """Two variants (the recipe as it is, and one override) of a 2-step EAGLE-3 recipe on a tiny target, each
    measured by scripts/benchmark.py. The script swallows a failed training or benchmark (its row gets nan),
    so a run that exits 0 proves nothing by itself: every number must be there."""
    from trainer_fixtures import make_setup

    # make_setup's --output_dir would override ablate_recipe's own OUT/NAME: left out
    common = [o for o in make_setup(tmp_path) if not o.startswith("--output_dir=")] + ["--train.max_steps=2"]
    # A few short questions: the tiny target has 256 positions and the tiny tokenizer makes mt_bench's prompts
    # longer than that. Two categories, the first of each is measured (--per-category 1).
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in [
        {"question_id": 1, "category": "math", "turns": ["What is 2+3?", "And 12 times 7?"]},
        {"question_id": 2, "category": "chat", "turns": ["Say hello."]},
        {"question_id": 3, "category": "chat", "turns": ["Name a colour."]}]))
    out = tmp_path / "ablation"
    proc = run("ablate_recipe.py", "--config", DEMO_CONFIG, "--out", out, "--variant", "baseline=",
               "--variant", "clip_1=--train.grad_clip=1.0", "--common", " ".join(common), "--target", tmp_path / "target",
               "--questions", questions, "--k", "2", "--max-new-tokens", "4", "--benchmarks", tmp_path / "B.md",
               "--title", "Tiny ablation", cwd=tmp_path)

    header = "| variant | tau (chain k=2) | held-out sim. accept len | train time | command |"
    body = section(tmp_path / "B.md", "Tiny ablation")
    rows = {r[0]: r for r in table_rows(body, header)}
    assert list(rows) == ["baseline", "clip_1"]
    assert "greedy chain k=2, 4 new tokens" in body
    for name, (_, tau, sim, train_time, command) in rows.items():
        assert 1.0 <= float(tau) <= 3.0, (name, tau, (out / f"{name}.bench.log").read_text()[-2000:])  # k=2: 1..k+1
        assert 1.0 <= float(sim) <= 4.0, (name, sim, (out / f"{name}.train.log").read_text()[-2000:])  # 3 TTT steps
        assert re.fullmatch(r"\d+ s", train_time), train_time
        assert command.startswith("`python scripts/train_eagle3.py --config ") and "--train.max_steps=2" in command
    assert "--train.grad_clip=1.0" in rows["clip_1"][4] and "--train.grad_clip" not in rows["baseline"][4]
    assert header in proc.stdout

    results = {r["name"]: r for r in json.loads((out / "ablation.json").read_text())}
    for name in ("baseline", "clip_1"):
        r = results[name]
        assert r["rc"] == 0 and r["train_s"] > 0 and f"{float(rows[name][1]):.2f}" == f"{r['tau']:.2f}"
        assert (out / name / "final").is_dir()
        # benchmark.py measured this variant's own head, on the first question of each category
        report = json.loads((out / f"{name}.bench" / "results.json").read_text())
        assert report["args"]["draft"] == str(out / name / "final") and report["args"]["method"] == "eagle3"
        assert {"math", "chat"} <= set(report["results"]) and report["results"]["overall"]["tau"] == r["tau"]


@pytest.mark.nightly  # a lab script run by hand, so with the nightly tests
def test_ablate_recipe_keeps_a_failed_variant_out_of_the_benchmarks_file(tmp_path):
    """A variant whose training fails (an unknown override) exits 1 naming it, and writes no row of NaNs to
    BENCHMARKS.md: with no variant measured, no section at all; next to a measured head (an existing one,
    --reference, which has no held-out figure or train time: dashes), only that head's row."""
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "chat", "turns": ["Say hello."]}) + "\n")

    def ablate(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(REPO / "benchmarks" / "ablate_recipe.py"), "--config", str(DEMO_CONFIG),
                               "--out", str(tmp_path / "ablation"), "--variant", "bad=--train.no_such_key=1",
                               "--questions", str(questions), "--max-new-tokens", "4", "--benchmarks",
                               str(tmp_path / "B.md"), *extra], cwd=tmp_path, env=OFFLINE, capture_output=True, text=True,
                              timeout=600)

    proc = ablate()
    assert proc.returncode == 1 and "failed: bad" in proc.stderr
    assert "| bad | nan |" in proc.stdout and not (tmp_path / "B.md").exists()
    proc = ablate("--reference", f"committed={REPO / 'configs/demo/eagle3-head'}")
    assert proc.returncode == 1 and "failed: bad" in proc.stderr
    rows = table_rows(section(tmp_path / "B.md", "Recipe ablation"),
                      "| variant | tau (chain k=4) | held-out sim. accept len | train time | command |")
    assert [r[0] for r in rows] == ["committed"] and rows[0][2:4] == ["-", "-"] and float(rows[0][1]) >= 1.0
    assert "Not measured (training or benchmark failed): bad." in section(tmp_path / "B.md", "Recipe ablation")


def test_bench_features_times_the_first_step_from_each_store(tmp_path):
    """Two feature stores of the same tiny data (5 shards and 1), written by generate_features; the script builds
    an offline trainer from each and times its first step."""
    from trainer_fixtures import make_setup

    from headstart.scripts import generate_features
    from headstart.trainer.config import load_config

    overrides = make_setup(tmp_path) + ["--features.batch_size=4"]
    manifests = {}
    for name, per_shard in (("five", 5), ("one", 24)):
        manifests[name] = generate_features.generate(load_config(str(DEMO_CONFIG), [
            *overrides, f"--features.samples_per_shard={per_shard}", f"--features.path={tmp_path / name}"]))
    assert [len(m["shards"]) for m in manifests.values()] == [5, 1]

    proc = run("bench_features.py", "--config", DEMO_CONFIG, "--stores", "five", "one", "--out", tmp_path / "B.md",
               *overrides, cwd=tmp_path)

    header = ("| store | shards | samples | bytes/token | build trainer (s) | first step (s) | "
              "time to first step (s) |")
    body = section(tmp_path / "B.md", "Offline training: time to the first step vs number of shards")
    rows = table_rows(body, header)
    assert [r[0] for r in rows] == ["`five`", "`one`"]
    for (_, shards, samples, per_token, build, first, total), manifest in zip(rows, manifests.values()):
        assert int(shards) == len(manifest["shards"]) and int(samples.replace(",", "")) == manifest["num_samples"] == 24
        assert int(per_token.replace(",", "")) == round(manifest["bytes"] / manifest["num_tokens"]) > 0
        assert float(build) >= 0 and float(first) > 0
        assert float(total) == pytest.approx(float(build) + float(first), abs=0.016)  # each of the three rounded to 0.01
    assert "| `five` | 5 | 24 |" in proc.stdout and "| `one` | 1 | 24 |" in proc.stdout


@pytest.mark.nightly  # a lab script run by hand, so with the nightly tests
def test_bench_memory_measures_before_and_after_at_one_length(tmp_path):
    """One short length (T=16), both implementations; on CPU each is a fresh worker process measuring peak RSS
    (on a GPU the script runs its CUDA path instead, and the same checks hold). The head is the script's own
    fixed size (hidden 1024, 32k vocabularies), so this takes ~20 s on 2 CPU cores. The dense loss ("before")
    and headstart's ("after") compute the same value from the same seeded inputs."""
    import torch

    plot = tmp_path / "memory.png"
    proc = run("bench_memory.py", "--lengths", "16", "--impls", "before", "after", "--plot", plot,
               "--benchmarks", tmp_path / "B.md", cwd=tmp_path)

    title = "Training memory by sequence length: TTT attention and loss" + (" (CUDA)" if torch.cuda.is_available() else "")
    body = section(tmp_path / "B.md", title)
    header = ("| T | before: peak extra memory / step time | after: peak extra memory / step time | "
              "memory before / after |")
    [row] = table_rows(body, header)
    assert row[0] == "16"
    for cell in row[1:3]:
        mib, seconds = re.fullmatch(r"([\d,]+) MiB / ([\d.]+) s", cell).groups()
        assert int(mib.replace(",", "")) > 0 and float(seconds) > 0
    assert row[3].endswith("x") and float(row[3][:-1]) > 0
    assert ("CPU, float32" in body) != torch.cuda.is_available()
    assert "![memory by length](memory.png)" in body  # relative to B.md, beside it
    assert plot.read_bytes().startswith(b"\x89PNG")

    measured = {r["impl"]: r for r in (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))}
    assert set(measured) == {"before", "after"} and all("error" not in r and r["T"] == 16 for r in measured.values())
    assert measured["after"]["loss"] == pytest.approx(measured["before"]["loss"], rel=1e-3 if torch.cuda.is_available()
                                                      else 1e-5)
    assert math.isfinite(measured["after"]["loss"]) and measured["after"]["loss"] > 0


@pytest.mark.nightly  # a lab script run by hand, so with the nightly tests
def test_bench_regenerate_runs_every_backend_on_the_demo_target(tmp_path):
    """hf at batch 1 and 16 in process, and openai against `transformers serve` (which the script starts, offline,
    on the demo target): one row from each of two demo data files, 4 new tokens, greedy."""
    data = [REPO / "configs/demo/data/gsm8k_train.jsonl", REPO / "configs/demo/data/gpteacher_codegen.json"]
    proc = run("bench_regenerate.py", "--target", DEMO_TARGET, "--data", *data, "--rows-per-file", "1",
               "--max-new-tokens", "4", "--temperature", "0", "--concurrency", "2", "--benchmarks", tmp_path / "B.md",
               cwd=tmp_path)

    text = (tmp_path / "B.md").read_text()
    assert "## Regenerating data: backend throughput" in text
    assert "2 conversations (the first 1 of each of 2 files), T = 0.0, max 4 new tokens" in text
    header = "| backend | rows | generated tokens | seconds | rows/s | tokens/s | vs hf batch 1 |"
    rows = {r[0]: r for r in table_rows(text, header)}
    assert list(rows) == ["hf, batch 1", "hf, batch 16", "openai, `transformers serve`, 2 in flight"]
    for _, n, tokens, seconds, rows_s, tokens_s, ratio in rows.values():
        assert int(n) == 2 and 2 <= int(tokens) <= 2 * 4
        assert float(seconds) >= 0 and float(rows_s) > 0 and float(tokens_s) > 0 and float(ratio.rstrip("x")) > 0
    assert rows["hf, batch 1"][6] == "1.00x"
    assert len({r[2] for r in rows.values()}) == 1  # greedy: every backend generates the same replies
    assert header in proc.stdout


@pytest.mark.slow  # 49 s here: with CI's slow tests, out of the default suite's ten minutes
def test_compare_methods_tabulates_two_benchmark_runs(tmp_path):
    """Two tiny scripts/benchmark.py runs on the demo target (n-gram with a datastore, chain of 2; the demo draft model, chain of 3,
    its two questions decoded as one batch by its batch drafter), then one table of both."""
    runs = []
    store = f"{REPO / 'configs/demo/data/gsm8k_train.jsonl'}[0:50]"  # n-gram lookup with a datastore of replies
    for k, batch, method in ((2, 1, ["ngram", "--ngram-store", store]),
                             (3, 2, ["draft-model", "--draft", str(REPO / "configs/demo/draft-model")])):
        out = tmp_path / f"{method[0]}-k{k}"
        bench = subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark.py"), "--target", str(DEMO_TARGET),
                                "--method", *method, "--questions", str(REPO / "configs/demo/eval/mt_bench.jsonl"),
                                "--limit", "2", "--max-new-tokens", "8", "--no-hf-reference", "--verify-greedy",
                                "--batch-size", str(batch), "--num-speculative-tokens", str(k), "--out", str(out)],
                               cwd=tmp_path, env=OFFLINE, capture_output=True, text=True, timeout=600)
        assert bench.returncode == 0, bench.stderr[-3000:]
        runs.append(out)

    proc = run("compare_methods.py", *runs, "--benchmarks", tmp_path / "B.md", "--title", "Tiny comparison",
               "--note", "A note under the table.", cwd=tmp_path)

    body = section(tmp_path / "B.md", "Tiny comparison")
    assert "max 8 new tokens" in body and f"target `{DEMO_TARGET}`" in body
    assert body.rstrip().endswith("A note under the table.")
    header = ("| method | draft | shape | mode | batch | tau | acceptance by position | spec tok/s | plain tok/s | "
              "speed-up | round ms: draft / update / verify / other | prompt ms per turn: speculative / plain | "
              "predicted speed-up | measured / predicted |")
    rows = table_rows(body, header)
    assert [r[:5] for r in rows] == [["ngram", f"store: `{store}`", "chain k=2", "greedy", "1"],
                                     ["draft-model", f"`{REPO / 'configs/demo/draft-model'}`", "chain k=3", "greedy", "2"]]
    for row, k, out in zip(rows, (2, 3), runs):
        overall = json.loads((out / "results.json").read_text())["results"]["overall"]
        assert overall["generated_tokens"] == 4 * 8  # two questions of two turns, 8 tokens each, batched or not
        _, _, _, _, _, tau, acceptance, spec, plain, speedup, split, prompt, predicted, ratio = row
        assert 1.0 <= float(tau) <= k + 1 and tau == f"{overall['tau']:.2f}"
        assert len(acceptance.split()) == k and all(0.0 <= float(a) <= 1.0 for a in acceptance.split())
        assert float(spec) > 0 and float(plain) > 0 and speedup.endswith("x") and float(speedup[:-1]) > 0
        parts = [float(x) for x in split.split(" / ")]
        assert len(parts) == 4 and all(x >= 0 for x in parts) and parts[2] > 0  # the target's verify forward costs time
        spec_prompt, plain_prompt = (float(x) for x in prompt.split(" / "))
        assert spec_prompt > 0 and plain_prompt > 0  # the target's forward over each turn's prompt
        assert float(predicted.rstrip("x")) > 0 and float(ratio) > 0
    assert header in proc.stdout
    here = json.loads((runs[0] / "results.json").read_text())["machine"]
    assert here.startswith("CPU") and f"- machine: {here}\n" in body

    # Runs brought back from another machine are tabled under that machine's name, never this one's, and runs
    # from two machines are not tabled together.
    for out, name in zip(runs, ("NVIDIA H200, torch 2.11.0+cu130", "NVIDIA H100, torch 2.11.0+cu130")):
        report = json.loads((out / "results.json").read_text())
        (out / "results.json").write_text(json.dumps({**report, "machine": name}))
    mixed = run("compare_methods.py", *runs, "--benchmarks", tmp_path / "C.md", cwd=tmp_path, check=False)
    assert mixed.returncode != 0 and "different machines" in mixed.stderr and not (tmp_path / "C.md").exists()
    report = json.loads((runs[1] / "results.json").read_text())
    (runs[1] / "results.json").write_text(json.dumps({**report, "machine": "NVIDIA H200, torch 2.11.0+cu130"}))
    run("compare_methods.py", *runs, "--benchmarks", tmp_path / "C.md", "--title", "On the GPU", cwd=tmp_path)
    assert "- machine: NVIDIA H200, torch 2.11.0+cu130\n" in section(tmp_path / "C.md", "On the GPU")


@pytest.mark.nightly
def test_a_hybrid_run_names_its_head_store_and_share_of_ngram_rounds(tmp_path):
    """scripts/benchmark.py --hybrid-ngram: the demo EAGLE-3 head behind n-gram lookup with a datastore that learns each
    reply (--ngram-learn), in a dynamic tree;
    its output is the target's greedy decoding, results.json counts which drafter drafted each round, and
    compare_methods' row names the head and the store and the share of n-gram rounds."""
    store = f"{REPO / 'configs/demo/data/gsm8k_train.jsonl'}[0:50]"
    out = tmp_path / "hybrid"
    bench = subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark.py"), "--target", str(DEMO_TARGET),
                            "--method", "eagle3", "--draft", str(REPO / "configs/demo/eagle3-head"), "--hybrid-ngram", "0.5",
                            "--ngram-store", store, "--ngram-learn", "--tree", "--tree-depth", "3", "--tree-topk", "2",
                            "--tree-total-tokens", "4", "--questions", str(REPO / "configs/demo/eval/mt_bench.jsonl"),
                            "--limit", "2", "--max-new-tokens", "24", "--no-hf-reference", "--verify-greedy",
                            "--out", str(out)], cwd=tmp_path, env=OFFLINE, capture_output=True, text=True, timeout=600)
    assert bench.returncode == 0, bench.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    rounds = report["hybrid_rounds"]
    assert rounds["ngram"] > 0 and rounds["model"] > 0  # both drafted on the demo's questions
    assert sum(rounds.values()) >= report["results"]["overall"]["generated_tokens"] / 4  # at most 3 drafts + 1 a round
    share = round(100 * rounds["ngram"] / sum(rounds.values()))
    run("compare_methods.py", out, "--benchmarks", tmp_path / "B.md", "--title", "Hybrid", cwd=tmp_path)
    header = ("| method | draft | shape | mode | batch | tau | acceptance by position | spec tok/s | plain tok/s | "
              "speed-up | round ms: draft / update / verify / other | prompt ms per turn: speculative / plain | "
              "predicted speed-up | measured / predicted |")
    (row,) = table_rows(section(tmp_path / "B.md", "Hybrid"), header)
    assert row[:4] == ["eagle3", f"`{REPO / 'configs/demo/eagle3-head'}` + store: `{store}`",
                       "dynamic tree (depth 3, top-2, 4 tokens)",
                       f"greedy, the store learning each reply, n-gram lookup first from 0.5 expected ({share}% of rounds)"]
    for bad in (["--method", "ngram", "--hybrid-ngram", "1"], ["--method", "eagle3", "--draft", "x", "--hybrid-ngram", "-1"]):
        refused = subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark.py"), "--target", str(DEMO_TARGET),
                                  *bad, "--questions", "q.jsonl", "--out", str(tmp_path / "no")], cwd=tmp_path, env=OFFLINE,
                                 capture_output=True, text=True, timeout=600)
        assert refused.returncode == 2 and "--hybrid-ngram SCORE (>= 0) puts n-gram lookup in front of" in refused.stderr


def test_ngram_policy_replay_gives_the_tau_decoding_gives_and_the_script_runs(tmp_path):
    """benchmarks/ngram_policies.py: replaying headstart's n-gram rule over the greedy output gives exactly the tau
    (and rounds) of decoding with that drafter; the oracle accepts as much with no more drafted tokens; the
    match-length rule drafts at most n tokens after an n-token match; the script runs on the demo target and writes
    its table."""
    import torch
    from tiny_models import tiny_causal_lm

    sys.path.insert(0, str(REPO / "benchmarks"))
    from ngram_policies import headstart_rule, match_length_rule, replay

    from headstart.decode.generate import plain_generate, speculative_generate
    from headstart.decode.ngram import NgramDrafter
    from headstart.decode.target_runner import TargetRunner
    from headstart.models.target import Target

    runner = TargetRunner(Target(tiny_causal_lm("llama", num_hidden_layers=8)), max_len=200)
    phrase = torch.randint(3, 128, (9,), generator=torch.Generator().manual_seed(3))
    prompt = torch.cat([phrase, phrase, phrase[:4]]).unsqueeze(0)
    out = plain_generate(runner, prompt, 60, set()).tokens
    cost = [1.0 + n for n in range(13)]
    for max_ngram, k in ((3, 4), (8, 8)):
        decoded = speculative_generate(runner, NgramDrafter(max_ngram), prompt, 60, set(), k=k)
        assert decoded.tokens == out
        replayed = replay([(prompt[0].tolist(), out)], headstart_rule(max_ngram), k, cost, max_new_tokens=60)
        assert replayed["tau"] == pytest.approx(decoded.tau) and decoded.tau > 1.2
        # the last rounds' drafts cut to the budget left, as the decoder cuts them
        assert replayed["drafted"] == pytest.approx(sum(decoded.proposed) / len(decoded.proposed))
        oracle = replay([(prompt[0].tolist(), out)], headstart_rule(max_ngram), k, cost, oracle=True, max_new_tokens=60)
        assert oracle["tau"] == replayed["tau"] and oracle["drafted"] < replayed["drafted"]
    ctx = [0, 6, 7, 8, 9, 1, 2, 7, 8, 3, 4, 5, 6, 7, 8]  # longest earlier match: [6, 7, 8]; [7, 8] also at 7
    assert match_length_rule(4)(ctx, 8) == [9, 1, 2] and headstart_rule(4)(ctx, 8) == [9, 1, 2, 7, 8, 3, 4, 5]
    assert match_length_rule(4)([1, 2, 3, 9, 4, 3], 8) == [9]  # a 1-token match: one token

    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["Say hi.", "Again."]}) + "\n")
    bench = tmp_path / "BENCHMARKS.md"
    run("ngram_policies.py", "--target", DEMO_TARGET, "--questions", questions, "--max-new-tokens", 24, "--out", bench,
        cwd=tmp_path)
    rows = table_rows(section(bench, "n-gram draft lengths: rules replayed on the target's greedy outputs"),
                      "| rule | k | tau | drafted per round | modelled tokens/s | vs transformers' k=4 |")
    assert len(rows) == 15 and rows[0][:2] == ["transformers' prompt lookup", "4"] and rows[0][-1] == "1.000x"
    assert [r[0] for r in rows[::3]] == ["transformers' prompt lookup", "headstart, n-grams up to 3, draft k",
                                         "headstart, n-grams up to 8, draft k", "headstart, n-grams up to 8, draft min(k, n)",
                                         "oracle length of headstart's n-grams up to 8"]
    assert all(float(r[2]) >= 1.0 and float(r[4]) > 0 for r in rows)


def test_tree_shapes_replays_every_shape_that_fits_and_ranks_them(tmp_path):
    """benchmarks/tree_shapes.py on the demo head: every chain, n-gram lookup, and each tree of the grid for both (a total
    above what depth and top-k can hold runs as the full tree), ranked by modelled speed-up, each one's best named; the speed-up
    is plain seconds a token over the speculative ones the JSON's parts add up to."""
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "math", "turns": ["What is 12 times 7?"]}) + "\n")
    bench, out = tmp_path / "BENCHMARKS.md", tmp_path / "shapes.json"
    # the store: the demo target's own greedy reply to the question, as a conversation (what a regenerated set holds)
    from headstart.decode.generate import greedy_generate
    from headstart.decode.target_runner import TargetRunner
    from headstart.models.target import Target, TargetConfig, load_tokenizer

    tokenizer = load_tokenizer(str(DEMO_TARGET))
    messages = [{"role": "user", "content": "What is 12 times 7?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    reply = greedy_generate(TargetRunner(Target.from_pretrained(TargetConfig(path=str(DEMO_TARGET))), max_len=128),
                            ids["input_ids"], 32, set()).tokens
    store = tmp_path / "replies.jsonl"
    store.write_text(json.dumps({"messages": messages + [{"role": "assistant", "content": tokenizer.decode(
        reply, skip_special_tokens=True)}]}) + "\n")
    run("tree_shapes.py", "--target", DEMO_TARGET, "--method", "eagle3", "--draft", REPO / "configs/demo/eagle3-head",
        "--questions", questions, "--max-new-tokens", 32, "--chains", "2,4", "--depths", "2,3", "--topks", "2,3",
        "--totals", "4,8,20", "--repeats", 1, "--show", 3, "--ngram-trees", "--ngram-store", store, "--out", out,
        "--hybrid-scores", "0,100", "--benchmarks", bench, cwd=tmp_path)
    rows = json.loads(out.read_text())["rows"]
    for method in ("eagle3", "ngram", "ngram+store", "hybrid >= 0", "hybrid >= 100"):
        trees = sorted((r["tree"]["depth"], r["tree"]["topk"], r["tree"]["total_tokens"]) for r in rows
                       if r["tree"] and r["method"] == method)
        # depth 2 top-2 holds 6 nodes, depth 2 top-3 12, depth 3 top-2 10: a larger total runs as the full tree, once
        assert trees == [(2, 2, 4), (2, 2, 6), (2, 3, 4), (2, 3, 8), (2, 3, 12), (3, 2, 4), (3, 2, 8), (3, 2, 10),
                         (3, 3, 4), (3, 3, 8), (3, 3, 20)]
    assert sorted((r["method"], r["shape"]) for r in rows if not r["tree"]) == [
        ("eagle3", "chain k=2"), ("eagle3", "chain k=4"), ("hybrid >= 0", "chain k=2"), ("hybrid >= 0", "chain k=4"),
        ("hybrid >= 100", "chain k=2"), ("hybrid >= 100", "chain k=4"), ("ngram", "chain k=4"), ("ngram+store", "chain k=4")]
    # the head behind n-gram lookup: never asked to step aside at 100 expected drafts (the head's own tau in every
    # shape), n-gram lookup drafting wherever it can at 0
    by = {(r["method"], r["shape"]): r for r in rows}
    for (method, shape), r in by.items():
        if method == "hybrid >= 100":
            assert r["ngram_share"] == 0 and r["tau"] == by[("eagle3", shape)]["tau"]
    assert all(r["ngram_share"] > 0.3 for r in rows if r["method"] == "hybrid >= 0")
    assert [r["speedup"] for r in rows] == sorted((r["speedup"] for r in rows), reverse=True)
    assert all(r["tau"] >= 1.0 and r["tokens"] > 0 for r in rows)
    plain_s = json.loads(out.read_text())["plain_s"]
    for r in rows:
        spec_s = r["draft_s"] + r["update_s"] + r["other_s"] + r["verify_s"]
        assert r["speedup"] == pytest.approx(r["tokens"] * plain_s / spec_s)
        assert r["verify_s"] > (r["mask_s"] if r["tree"] else 0)  # the modelled forwards are in it
    assert max(r["tau"] for r in rows if r["tree"]) > 1.5  # the demo head accepts: the replay did not just reject
    text = section(bench, "Draft shapes replayed: eagle3 chains and trees against n-gram lookup")
    table = table_rows(text, "| method | shape | tau | ms per round: draft / update / verify / other | modelled tok/s | "
                             "modelled speed-up |")
    assert len(table) == 3 + 8 and [r[1] for r in table[:3]] == [r["shape"] for r in rows if r["tree"]][:3]
    for method, flags in (("eagle3", "--method eagle3"), ("ngram", "--method ngram"),
                          ("ngram+store", f"--method ngram --ngram-store {store}"),
                          ("hybrid >= 0", f"--method eagle3 --draft {REPO / 'configs/demo/eagle3-head'} --hybrid-ngram 0 "
                                          f"--ngram-store {store}")):
        best = next(r for r in rows if r["tree"] and r["method"] == method)["tree"]
        assert (f"Best {method} tree: `{flags} --tree --tree-depth {best['depth']} --tree-topk {best['topk']} "
                f"--tree-total-tokens {best['total_tokens']}`") in text
    tau = {r["method"]: r["tau"] for r in rows if r["shape"] == "chain k=4"}
    assert tau["ngram+store"] > tau["ngram"] + 0.5  # the store's reply is the reply: its drafts are accepted


def test_drafter_launches_tables_a_compiled_drafter(tmp_path):
    """benchmarks/drafter_launches.py end to end on the demo target's Medusa heads (one small graph to compile)."""
    run("drafter_launches.py", "--target", DEMO_TARGET, "--heads", f"medusa={REPO / 'configs/demo/medusa-head'}",
        "--out", tmp_path / "B.md", "--note", "A note.", cwd=tmp_path)
    body = section(tmp_path / "B.md", "Eager ops per round of a compiled drafter")
    rows = table_rows(body, "| head | draft | ops per propose | ops per update (3 tokens) | per round | "
                            "ops per dynamic tree (depth 6, top-8, 48 tokens) |")
    assert len(rows) == 1 and rows[0][0] == "medusa"
    propose, update, total = map(int, rows[0][2:5])
    tree = rows[0][5]
    assert tree == "-"  # the demo's 4 Medusa heads cannot grow a tree 6 levels deep (drafter_launches' EAGLE-3 row does)
    assert 0 < propose <= 8 and 0 < update <= 8 and total == propose + update  # heads on one hidden state: one graph
    assert body.rstrip().endswith("A note.")


@pytest.mark.slow  # 43 s here: with CI's slow tests, out of the default suite's ten minutes
def test_versus_decodes_a_second_method_in_the_same_run_and_compare_methods_pairs_them(tmp_path):
    """scripts/benchmark.py --versus: n-gram lookup and transformers' prompt lookup on the same turns in one process;
    the second method's run directory is OUT/versus (its own table row), results.json has the turn-by-turn
    comparison and compare_methods writes it under the table. A shared flag inside --versus is refused by name."""
    out = tmp_path / "pair"
    bench = [sys.executable, str(REPO / "scripts" / "benchmark.py"), "--target", str(DEMO_TARGET), "--questions",
             str(REPO / "configs/demo/eval/mt_bench.jsonl"), "--limit", "2", "--max-new-tokens", "16", "--no-hf-reference",
             "--verify-greedy", "--out", str(out), "--method", "ngram"]
    proc = subprocess.run([*bench, "--versus", "--method hf-prompt-lookup --num-speculative-tokens 3"], cwd=tmp_path,
                          env=OFFLINE, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    second = json.loads((out / "versus" / "results.json").read_text())
    assert report["versus_out"] == str(out / "versus") and second["paired_with"] == str(out)
    assert second["args"]["method"] == "hf-prompt-lookup" and second["args"]["num_speculative_tokens"] == 3
    assert second["args"]["max_new_tokens"] == 16 and second["args"]["limit"] == 2  # the first's settings
    assert report["paired"]["turns"] == 4 and second["results"]["overall"]["generated_tokens"] == 4 * 16
    run("compare_methods.py", out, out / "versus", "--benchmarks", tmp_path / "B.md", "--title", "Pair", cwd=tmp_path)
    text = section(tmp_path / "B.md", "Pair")
    header = ("| method | draft | shape | mode | batch | tau | acceptance by position | spec tok/s | plain tok/s | "
              "speed-up | round ms: draft / update / verify / other | prompt ms per turn: speculative / plain | "
              "predicted speed-up | measured / predicted |")
    assert [row[:3] for row in table_rows(text, header)] == [["ngram", "`-`", "chain k=4"],
                                                             ["hf-prompt-lookup", "`-`", "chain k=3"]]
    ratio = report["paired"]["overall_ratio"]
    assert f"`{out}` and `{out / 'versus'}`: Paired in one process (4 turns" in text
    assert f"ngram / hf-prompt-lookup tokens/s {ratio:.3f}x over all turns" in text
    for inside, named in (("--max-new-tokens 8", "--max-new-tokens"), ("--predict", "--predict")):
        refused = subprocess.run([*bench, "--versus", f"--method hf-prompt-lookup {inside}"], cwd=tmp_path,
                                 env=OFFLINE, capture_output=True, text=True, timeout=600)
        assert refused.returncode == 2 and f"{named} is the first's" in refused.stderr


@pytest.mark.slow  # 37 s here: with CI's slow tests, out of the default suite's ten minutes
def test_the_models_own_tree_behind_ngram_lookup_is_named_and_refused_where_it_cannot_be(tmp_path):
    """--hybrid-model-tree: compare_methods names the model's tree in the mode column; the flag is refused without
    --hybrid-ngram and --tree, or with more tokens than the verify block holds (before the target loads)."""
    from headstart.benchmarks.compare_methods import mode

    args = {"hybrid_ngram": 1.25, "hybrid_model_tree": [3, 4, 8], "dtype": "bfloat16"}
    assert mode(args, {"hybrid_rounds": {"ngram": 3, "model": 1}}) == (
        "greedy, bfloat16, n-gram lookup first from 1.25 expected (75% of rounds), the model's trees depth 3 top-4 8 tokens")
    base = [sys.executable, str(REPO / "scripts" / "benchmark.py"), "--target", str(DEMO_TARGET), "--questions", "q.jsonl",
            "--out", str(tmp_path / "no"), "--method", "eagle3", "--draft", "x"]
    for bad in (["--hybrid-model-tree", "3", "4", "8", "--tree"],
                ["--hybrid-ngram", "1", "--hybrid-model-tree", "3", "4", "8"],
                ["--hybrid-ngram", "1", "--tree", "--tree-total-tokens", "8", "--hybrid-model-tree", "3", "4", "12"],
                ["--hybrid-ngram", "1", "--tree", "--tree-depth", "4", "--hybrid-model-tree", "5", "4", "8"]):
        refused = subprocess.run([*base, *bad], cwd=tmp_path, env=OFFLINE, capture_output=True, text=True, timeout=600)
        assert refused.returncode == 2 and "--hybrid-model-tree DEPTH TOPK TOKENS is the model's tree" in refused.stderr


@pytest.mark.slow  # two decodes of two MT-bench turns on the demo target, ~20 s
def test_versus_revision_pairs_a_heads_drafter_with_the_same_heads_at_a_git_revision(tmp_path):
    """benchmarks/versus_revision.py: the demo EAGLE-3 head's drafter at HEAD against the same file at HEAD~0 (the
    revision's class loaded from git), greedy-exact both, the pair in results.json; a revision without the file is
    refused with git's words."""
    out = tmp_path / "pair"
    common = ["--target", str(DEMO_TARGET), "--draft", str(REPO / "configs/demo/eagle3-head"), "--method", "eagle3",
              "--questions", str(REPO / "configs/demo/eval/mt_bench.jsonl"), "--limit", "1", "--max-new-tokens", "12",
              "--no-hf-reference", "--verify-greedy", "--num-speculative-tokens", "3"]
    run("versus_revision.py", "--rev", "HEAD", "--", *common, "--out", out, cwd=tmp_path)
    report = json.loads((out / "results.json").read_text())
    second = json.loads((out / "versus" / "results.json").read_text())
    assert second["args"]["method"] == "eagle3@HEAD" and second["args"]["num_speculative_tokens"] == 3
    assert report["paired"]["turns"] == 2 and report["mismatches"] == [] and second["mismatches"] == []
    # the same drafter code on both sides: the same acceptance, turn by turn
    assert report["results"]["overall"]["tau"] == second["results"]["overall"]["tau"] > 1.0
    refused = run("versus_revision.py", "--rev", "0000000", "--", *common, "--out", tmp_path / "x", cwd=tmp_path, check=False)
    assert refused.returncode != 0 and "git show 0000000:heads/eagle3/drafter.py failed" in refused.stderr
