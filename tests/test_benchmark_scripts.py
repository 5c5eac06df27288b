"""The drivers in benchmarks/ (and run.py's suites), each run for real, end to end, on the smallest setup that
exercises it.

These scripts are run by hand and rarely; without a test a refactor breaks them silently. Each test runs the script
as a user does (a subprocess, in a temporary directory) and checks the table it writes. Nothing here downloads
anything: the targets are the committed demo target or a tiny random one written by ``trainer_fixtures.make_setup``.
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
    """What follows the title of the table file a driver wrote to ``path`` (benchmarks/record.py ``write_table``):
    its provenance lines, then the table."""
    text = path.read_text()
    assert text.startswith(f"# {title}\n") and "\n- commit: " in text and "\n- date: " in text, text[:2000]
    return text.split("\n", 1)[1]


@pytest.mark.nightly  # a lab script run by hand, so with the nightly tests
def test_bench_memory_measures_before_and_after_at_one_length(tmp_path):
    """One short length (T=16), both implementations; on CPU each is a fresh worker process measuring peak RSS
    (on a GPU the script runs its CUDA path instead, and the same checks hold). The head is the script's own
    fixed size (hidden 1024, 32k vocabularies), so this takes ~20 s on 2 CPU cores. The dense loss ("before")
    and headstart's ("after") compute the same value from the same seeded inputs."""
    import torch

    plot = tmp_path / "memory.png"
    proc = run("bench_memory.py", "--lengths", "16", "--impls", "before", "after", "--plot", plot,
               "--table", tmp_path / "B.md", cwd=tmp_path)

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


@pytest.mark.slow  # 49 s here: with CI's slow tests, out of the default suite's ten minutes
def test_compare_methods_tabulates_two_benchmark_runs(tmp_path):
    """Two tiny scripts/benchmark.py runs on the demo target (n-gram with a datastore, chain of 2; the demo draft model, chain of 3,
    its two questions decoded as one batch by its batch drafter), then one table of both, each run's shape and mode as
    it named them."""
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

    proc = run("compare_methods.py", *runs, "--table", tmp_path / "B.md", "--title", "Tiny comparison",
               "--note", "A note under the table.", cwd=tmp_path)

    body = section(tmp_path / "B.md", "Tiny comparison")
    assert "max 8 new tokens" in body and f"target `{DEMO_TARGET}`" in body
    assert body.rstrip().endswith("A note under the table.")
    header = ("| method | draft | shape | mode | batch | tau | acceptance by position | spec tok/s | plain tok/s | "
              "speed-up | round ms: draft / update / verify / other | prompt ms per turn: speculative / plain | "
              "predicted speed-up | measured / predicted |")
    rows = table_rows(body, header)
    assert [r[:5] for r in rows] == [["ngram", f"store: `{store}`", "chain k=2", "greedy", "1"],
                                     ["draft-model", f"`{REPO / 'configs/demo/draft-model'}`", "chain k=3", "greedy, batch 2",
                                      "2"]]
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
    mixed = run("compare_methods.py", *runs, "--table", tmp_path / "C.md", cwd=tmp_path, check=False)
    assert mixed.returncode != 0 and "different machines" in mixed.stderr and not (tmp_path / "C.md").exists()
    report = json.loads((runs[1] / "results.json").read_text())
    (runs[1] / "results.json").write_text(json.dumps({**report, "machine": "NVIDIA H200, torch 2.11.0+cu130"}))
    run("compare_methods.py", *runs, "--table", tmp_path / "C.md", "--title", "On the GPU", cwd=tmp_path)
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
    run("compare_methods.py", out, "--table", tmp_path / "B.md", "--title", "Hybrid", cwd=tmp_path)
    header = ("| method | draft | shape | mode | batch | tau | acceptance by position | spec tok/s | plain tok/s | "
              "speed-up | round ms: draft / update / verify / other | prompt ms per turn: speculative / plain | "
              "predicted speed-up | measured / predicted |")
    (row,) = table_rows(section(tmp_path / "B.md", "Hybrid"), header)
    assert row[:4] == ["eagle3", f"`{REPO / 'configs/demo/eagle3-head'}` + store: `{store}`",
                       "dynamic tree depth 3 top-k 2 4 tokens", report["mode"]]
    assert re.fullmatch(r"greedy, the store learning each reply \(\d+ tokens learned\), n-gram lookup first from 0.5 "
                        rf"expected \({share}% of rounds\)", row[3]), row[3]
    for bad, said in ((["--method", "ngram", "--hybrid-ngram", "1"], "n-gram lookup cannot take the rounds of --method ngram"),
                      (["--method", "eagle3", "--draft", "x", "--hybrid-ngram", "-1"],
                       "--hybrid-ngram SCORE (>= 0) puts n-gram lookup in front of")):
        refused = subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark.py"), "--target", str(DEMO_TARGET),
                                  *bad, "--questions", "q.jsonl", "--out", str(tmp_path / "no")], cwd=tmp_path, env=OFFLINE,
                                 capture_output=True, text=True, timeout=600)
        assert refused.returncode == 2 and said in refused.stderr


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
        "--hybrid-scores", "0,100", "--table", bench, cwd=tmp_path)
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
    run("compare_methods.py", out, out / "versus", "--table", tmp_path / "B.md", "--title", "Pair", cwd=tmp_path)
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
    """--hybrid-model-tree: the run's mode (results.json, compare_methods' mode column) names the model's tree; the flag
    is refused without --hybrid-ngram and --tree, or with more tokens than the verify block holds (before the target
    loads)."""
    from headstart.decode.report import run_mode
    from headstart.scripts.benchmark import build_parser

    args = build_parser().parse_args(["--target", "t", "--questions", "q", "--out", "o", "--method", "eagle3",
                                      "--hybrid-ngram", "1.25", "--hybrid-model-tree", "3", "4", "8"])
    assert run_mode(args, "bfloat16", "float32", hybrid_rounds={"ngram": 3, "model": 1}) == (
        "greedy, n-gram lookup first from 1.25 expected (75% of rounds), the model's trees depth 3 top-4 8 tokens, bfloat16")
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


def test_suites_list_their_steps_pick_the_named_ones_and_keep_a_dirty_checkout_out_of_the_results(tmp_path, monkeypatch,
                                                                                                    capsys):
    """benchmarks/run.py: every suite lists its steps; --only's shell patterns pick steps (the optional ones only when
    named, an unknown pattern refused); a suite that writes into benchmarks/results/ refuses a dirty checkout before
    its first step, and a result file written there from one is refused too (elsewhere, or with --allow-dirty, it is
    marked)."""
    from headstart.benchmarks import record, run as suites

    monkeypatch.chdir(tmp_path)  # run.main moves to the repository: put the test's directory back afterwards
    assert suites.main(["--list"]) == 0
    for name in suites.SUITES:
        assert suites.main([name, "--list"]) == 0
    listed = capsys.readouterr().out
    assert "- collect: (its command is built when it starts" in listed and "[timed]" in listed
    steps = suites.SUITES["smollm2-gpu"].steps(suites.Settings(Path("runs/x"), dict(suites.SUITES["smollm2-gpu"].settings)))
    default = [s.name for s in suites.chosen(steps, [])]
    assert default[0] == "import" and "shapes" not in default and not any(n.startswith("batch-") for n in default)
    assert [s.name for s in suites.chosen(steps, ["shapes", "bench-eagle3-k?"])] == [
        "bench-eagle3-k3", "bench-eagle3-k4", "bench-eagle3-k5", "shapes"]
    with pytest.raises(SystemExit, match="--only nope: no step"):
        suites.chosen(steps, ["nope"])
    with pytest.raises(SystemExit):
        suites.main(["heads-demo", "--set", "colour=red"])
    assert "--set colour=red: heads-demo's settings are none" in capsys.readouterr().err

    monkeypatch.setattr(suites, "commit", lambda: "0123456789ab-dirty")
    with pytest.raises(SystemExit, match="uncommitted changes"):
        suites.main(["hydra-demo", "--only", "collect"])
    made = {"command": "x", "commit": "0123456789ab-dirty", "machine": "CPU", "date": "2026-12-01T00:00:00+00:00"}
    monkeypatch.setattr(record, "provenance", lambda: made)
    with pytest.raises(SystemExit, match="uncommitted changes"):
        record.write_result(record.RESULTS / "never_written.json", {"title": "t"})
    assert not (record.RESULTS / "never_written.json").exists()
    written = record.write_result(tmp_path / "r.json", {"title": "t"})
    assert written["dirty"] is True and json.loads((tmp_path / "r.json").read_text())["commit"] == made["commit"]
    record.write_table(tmp_path / "t.md", "A table", "| a |\n|---|\n| 1 |")
    assert "- commit: 0123456789ab-dirty -- UNCOMMITTED CHANGES" in (tmp_path / "t.md").read_text()

    for name in ("eagle3-chain", "eagle3-chain.old-20261202-035845", "no-results"):  # a rerun moved one aside
        (tmp_path / "runs" / name).mkdir(parents=True)
        if name != "no-results":
            (tmp_path / "runs" / name / "results.json").write_text("{}")
    assert [d.name for d in suites.runs_in(tmp_path / "runs")] == ["eagle3-chain"]


def test_the_all_drafts_suites_decode_the_drafters_that_need_no_training_too(tmp_path, monkeypatch):
    """Each all-drafts table has a row for every drafting method that needs no training; Draft & Verify's row skips
    the layers the search found at its count."""
    from headstart.benchmarks import run as suites

    names = {}
    for which in ("demo", "smollm2"):
        suite = suites.SUITES[f"heads-{which}"]
        names[which] = {s.name: s for s in suite.steps(suites.Settings(tmp_path / which, dict(suite.settings)))}
    for method in ("lookahead", "rest-chain", "ngram-chain", "suffix-chain", "layer-skip-chain"):
        assert method in names["demo"] and method in names["smollm2"], method
    assert {"staged-chain", "dspark-chain", "dflash2-chain", "draft-model-chain"} <= names["demo"].keys()
    # SmolLM2's DSpark and DFlash2 rows decode the heads dspark-smollm2 and dflash2-smollm2 publish (under runs/: their
    # vocabulary-size tables are over the repository's file size), where they are; the demo's are committed
    for head in ("dspark", "dflash2"):
        assert names["smollm2"][f"{head}-chain"].needs == (f"runs/smollm2-{head}-head",)
        assert names["demo"][f"{head}-chain"].needs == (f"configs/demo/{head}-head",)
        variant = suites.SUITES[f"{head}-smollm2"]
        steps = {s.name: s for s in variant.steps(suites.Settings(tmp_path / head, dict(variant.settings)))}
        publish = steps[f"publish-{head}"].argv
        assert publish[publish.index("--run") + 1] == f"runs/smollm2-{head}"
        assert publish[publish.index("--out") + 1] == f"runs/smollm2-{head}-head"
        assert list(steps).index(f"train-{head}") < list(steps).index(f"publish-{head}") < list(steps).index("collect")
    assert names["smollm2"]["rest-chain"].needs == ("runs/datastore-smollm2",)
    drafted = ("runs/smollm2-distilled-draft-model",)  # staged drafting's draft model: trained and published by the suite
    assert names["smollm2"]["staged-chain"].needs == names["smollm2"]["distilled-draft-model-chain"].needs == drafted
    assert names["smollm2"]["publish-distill"].skip_if == drafted[0]
    monkeypatch.chdir(tmp_path)
    found = tmp_path / "runs" / "layer-skip-smollm2" / "search.json"
    found.parent.mkdir(parents=True)
    found.write_text(json.dumps({"path": [{"skip": [3]}, {"skip": [3, 27]}] + [{"skip": list(range(i))} for i in range(3, 13)]}))
    argv = names["smollm2"]["layer-skip-chain"].argv()
    assert argv[argv.index("--skip-layers") + 1] == "0,1,2,3,4,5,6,7" and argv[argv.index("--method") + 1] == "layer-skip"
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "layer-skip-search.json").write_text(json.dumps({"path": [{"skip": [2]}, {"skip": [2, 3]},
                                                                               {"skip": [1, 2, 3]}]}))
    argv = names["demo"]["layer-skip-chain"].argv()
    assert argv[argv.index("--skip-layers") + 1] == "1,2,3" and argv[argv.index("--target") + 1] == "configs/demo/target"
    assert names["demo"]["layer-skip-search"].skip_if == str(tmp_path / "demo" / "layer-skip-search.json")


@pytest.mark.slow  # two tiny decodes on the demo target, ~30 s
def test_the_batch_suite_decodes_at_each_batch_size_and_tables_the_runs(tmp_path):
    """``python benchmarks/run.py batch`` with its settings cut down: n-gram lookup at batch 1 and 2 on two questions,
    each step's log and run directory, then compare_methods' table of both; --deadline 0 skips every step."""
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n"
                                 for i, (c, t) in enumerate((("math", "What is 2+3?"), ("chat", "Say hello.")))))
    out = tmp_path / "batch"
    settings = ["--set", "methods=ngram", "--set", "batches=1 2", "--set", f"questions={questions}", "--set",
                "max_new_tokens=4"]
    proc = run("run.py", "batch", "--out", out, *settings, cwd=tmp_path)
    assert "done: 0 failed" in proc.stdout and (out / "ngram-b1.log").is_file()
    for b in (1, 2):
        report = json.loads((out / f"ngram-b{b}" / "results.json").read_text())
        assert report["args"]["batch_size"] == b and report["mismatches"] == []
        assert report["command"].startswith("headstart bench --target configs/demo/target")
    rows = table_rows(section(out / "table.md", "Decoding by batch size"),
                      "| method | draft | shape | mode | batch | tau | acceptance by position | spec tok/s | plain tok/s | "
                      "speed-up | round ms: draft / update / verify / other | prompt ms per turn: speculative / plain | "
                      "predicted speed-up | measured / predicted |")
    assert [r[4] for r in rows] == ["1", "2"]
    skipped = run("run.py", "batch", "--out", tmp_path / "none", *settings, "--deadline", "0", cwd=tmp_path)
    assert "skipped, past --deadline" in skipped.stdout and not (tmp_path / "none" / "ngram-b1").exists()


@pytest.mark.parametrize("which,at_least", [("demo", 9), ("smollm2", 4)])
def test_block_verification_suite_decodes_every_committed_draft_that_gives_q(which: str, at_least: int):
    """block-demo's and block-smollm2's heads are every committed draft of their target whose drafter samples from a q
    of its own (its catalog entry's capabilities), each under its own method: a head added to the catalog and
    committed joins the table."""
    from headstart.benchmarks.run import SUITES
    from headstart.heads.methods import drafting_methods
    from headstart.heads.registry import HEADS

    listed = dict(reversed(entry.split("=")[:2]) for entry in SUITES[f"block-{which}"].settings["heads"].split())
    methods, gives_q = drafting_methods(), {}
    for d in sorted((REPO / "configs" / which).iterdir()):
        if (d / "headstart.json").is_file():
            head = json.loads((d / "headstart.json").read_text())["head"]
            method = HEADS[head].decoded_by or head
        elif d.name.endswith("draft-model") and (d / "model.safetensors").is_file():
            method = "draft-model"
        else:
            continue
        if methods[method].capabilities.sampled:
            gives_q[f"configs/{which}/{d.name}"] = method
    assert len(gives_q) >= at_least and listed == gives_q


def test_a_verification_suite_run_on_fewer_heads_says_which_it_decoded():
    """block-smollm2 with ``--set heads=`` naming one head: its result file's text names that head as the only one
    decoded (the suite's own text says every head that gives q); at the default it adds nothing."""
    from headstart.benchmarks.run import SUITES, Settings

    suite = SUITES["block-smollm2"]

    def what(heads: str) -> str:
        steps = suite.steps(Settings(Path("runs/x"), {**suite.settings, "heads": heads}))
        argv = next(step.argv for step in steps if step.name == "collect")
        return argv[argv.index("--what") + 1]

    one = what("eagle3=configs/smollm2/eagle3-head")
    assert one.endswith("-- this run decoded only configs/smollm2/eagle3-head")
    assert "decoded only" not in what(suite.settings["heads"])


def test_the_budget_sweep_collects_the_cells_that_finished_and_names_the_rest(tmp_path, monkeypatch):
    """block-budget run a few cells at a time: its result file collects the committed heads and the trained runs that
    reached ``final``, and its text names every cell that did not, so a partial sweep never reads as the whole."""
    from headstart.benchmarks.run import SUITES, Settings

    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(REPO / "configs")
    (tmp_path / "runs" / "budget" / "dspark-3000" / "final").mkdir(parents=True)
    suite = SUITES["block-budget"]
    steps = suite.steps(Settings(tmp_path / "out", {**suite.settings, "heads": "eagle3 dspark dflash-published"}))
    argv = next(step for step in steps if step.name == "collect").argv()
    trained = [argv[i + 1] for i, a in enumerate(argv) if a == "--train"]
    assert trained == ["eagle3-1000=configs/demo/eagle3-head", "dspark-1000=configs/demo/dspark-head",
                       f"dspark-3000=runs/budget/dspark-3000:{tmp_path / 'out'}/train-dspark-3000.time"]
    assert argv[argv.index("--what") + 1].endswith(
        "-- not trained in this run: eagle3-3000, dflash-published-1000, dflash-published-3000")
