"""BENCHMARKS.md is what benchmarks/results_page.py writes from the committed result files, and the README quotes it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from headstart.benchmarks import results_page

ROOT = Path(__file__).resolve().parents[1]


def test_benchmarks_md_is_generated_from_the_result_files() -> None:
    pages = results_page.pages(results_page.load())
    for name, text in pages.items():
        assert (ROOT / name).read_text() == text, f"{name}: run python benchmarks/results_page.py"
        # current figures only: repeated baselines folded, shared command words said once
        assert len(text.encode()) <= 30 * 1024, name
    assert sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "benchmarks" / "pages").glob("*.md")) == sorted(
        name for name in pages if name != "BENCHMARKS.md")  # no page left from a target that has none now
    assert all(f"]({name})" in pages["BENCHMARKS.md"] for name in pages if name != "BENCHMARKS.md")
    assert results_page.main(["--check"]) == 0


def test_user_docs_name_no_issue_and_hold_no_todo_list() -> None:
    pages = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md")),
             *sorted((ROOT / "benchmarks" / "pages").glob("*.md"))]
    for page in pages:
        text = page.read_text()
        assert not re.search(r"issue [0-9]+", text, re.I), page
        assert "still to measure" not in text and "still to run" not in text, page
    assert len((ROOT / "README.md").read_text().encode()) <= 12 * 1024


def readme_figures() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- figures: BENCHMARKS.md -->(.*?)<!-- /figures -->", text, re.S)
    assert block, "README.md marks the figures it quotes from BENCHMARKS.md"
    return re.findall(r"\d+\.\d+x?", block.group(1))


def test_readme_figures_are_quoted_from_the_results_page() -> None:
    figures = readme_figures()
    assert len(figures) >= 4
    page = results_page.render(results_page.load())  # BENCHMARKS.md and the comparisons pages
    missing = [f for f in figures if f not in page]
    assert not missing, f"README.md quotes figures the results pages do not have: {missing}"


def bench_record(target: str, tau: float) -> dict:
    run = {"method": "ngram", "draft": None, "target": target, "shape": "chain k=4", "mode": "greedy",
           "conditions": "mt_bench.jsonl (all, every turn), 8 new tokens, float32, batch 1", "k": 4, "tau": tau,
           "acceptance_by_position": [0.5, 0.25], "round_ms": {"draft": 0.1, "update": 0.0, "verify": 5.0, "other": 0.2},
           "tokens_per_s": 10.0, "plain_tokens_per_s": 8.0, "speedup": 1.25, "predicted_speedup": 1.3,
           "command": "python scripts/benchmark.py --method ngram"}
    return {"title": f"n-gram on {target}", "what": "n-gram lookup", "command": "x", "commit": "abc", "machine": "CPU",
            "date": "2026-11-28T00:00:00+00:00", "train": {}, "bench": {"ngram": {"first": run}}}


def test_the_page_groups_by_target_and_machine_and_shows_each_figure(tmp_path: Path) -> None:
    (tmp_path / "a_all_drafts.json").write_text(json.dumps(bench_record("targets/A", 1.875)))
    (tmp_path / "b_all_drafts.json").write_text(json.dumps(bench_record("targets/B", 2.125)))
    text = results_page.render(results_page.load(tmp_path))
    assert text.index("## `targets/A` on CPU") < text.index("1.88") < text.index("## `targets/B` on CPU") < text.index("2.12")
    # shown as headstart bench, whichever launcher a result file recorded
    assert "`headstart bench --method ngram`" in text and "commit `abc`, 2026-11-28" in text
    out = tmp_path / "page.md"
    assert results_page.main(["--results", str(tmp_path), "--out", str(out)]) == 0
    assert results_page.main(["--check", "--results", str(tmp_path), "--out", str(out)]) == 0
    out.write_text(out.read_text() + "edited by hand\n")
    assert results_page.main(["--check", "--results", str(tmp_path), "--out", str(out)]) == 1


def test_a_result_file_without_provenance_is_refused_by_name(tmp_path: Path) -> None:
    record = bench_record("targets/A", 1.5)
    del record["commit"]
    (tmp_path / "bad.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match=r"bad.json: a result file needs 'commit'"):
        results_page.load(tmp_path)


def test_plan_rows_render_planned_against_measured(tmp_path: Path) -> None:
    record = {"title": "headstart plan against measured peaks", "what": "plan vs GNU time", "command": "x",
              "commit": "abc", "machine": "CPU", "date": "2026-11-28T00:00:00+00:00",
              "plan": [{"recipe": "configs/demo/eagle3.yaml", "ranks": 2, "overrides": [], "planned_gib": 1.15,
                        "measured_gib": 1.24, "ratio": 0.927, "command": "torchrun ..."}]}
    (tmp_path / "plan.json").write_text(json.dumps(record))
    text = results_page.render(results_page.load(tmp_path))
    assert "| `configs/demo/eagle3.yaml` | 2 | 1.24 GiB | 1.15 GiB | 0.93 | - | - |" in text and "- `torchrun ...`" in text
    del record["plan"]
    (tmp_path / "plan.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="needs 'bench' .*'plan'.*'verification'.*'training'.* or 'online'"):
        results_page.load(tmp_path)


def test_training_runs_render_side_by_side_against_the_peer(tmp_path: Path) -> None:
    run = {"steps": 253, "tokens_trained": 240000, "wall_s": 168.0, "peak_rss_gib": 1.04, "sim_accept_len": 1.98}
    record = {"title": "EAGLE-3 training throughput against vLLM's speculators", "what": "one epoch each.",
              "suite": "python benchmarks/run.py versus-speculators", "commit": "abc", "machine": "CPU",
              "date": "2026-12-03T00:00:00+00:00", "prepared": {"hidden_states_s": 61.0},
              "training": {"speculators": {**run, "tokens_per_s": 1600.0,
                                           "own_heldout": {"full_acc": [0.5, 0.3], "sim_accept_len": 1.8}},
                           "headstart-offline": {**run, "tokens_per_s": 2400.0, "sim_accept_len": 2.19,
                                                 "features": {"wall_s": 67.7}, "reached_at": {"step": 200, "loop_s": 80.7}}}}
    (tmp_path / "versus.json").write_text(json.dumps(record))
    text = results_page.render(results_page.load(tmp_path))
    assert "| speculators 0.9.0 | 253 | 240,000 | 1,600 | 1.00x | 168 s | 1.04 GiB | 1.980 | - |" in text
    assert ("| headstart, offline (from its feature store) | 253 | 240,000 | 2,400 | 1.50x | 168 s + features 68 s "
            "| 1.04 GiB | 2.190 | step 200 (81 s of loop) |") in text
    assert "own validation of its head on the same held-out rows: 1.800 (1 + its per-step full accuracies 0.500, 0.300)" in text


GNU_TIME = """\tCommand being timed: "python scripts/train_eagle3.py --config r.yaml"
\tUser time (seconds): 1500.25
\tSystem time (seconds): 20.50
\tElapsed (wall clock) time (h:mm:ss or m:ss): 1:02:03.5
\tMaximum resident set size (kbytes): 1572864
"""


def test_a_time_log_gives_wall_cpu_and_peak_memory_and_the_training_table_shows_them(tmp_path: Path) -> None:
    from headstart.benchmarks.heads_side_by_side import time_log

    (tmp_path / "run.time").write_text(GNU_TIME)
    got = time_log(tmp_path / "run.time")
    assert got == {"wall_s": 3723.5, "cpu_s": 1520.8, "peak_rss_gib": 1.5,
                   "command": "python scripts/train_eagle3.py --config r.yaml"}
    record = {"train": {"a": {**got, "step": 400, "sim_accept_len": 1.7, "acc_by_step": [0.7]},
                        "b": {"step": 10, "sim_accept_len": 1.2}}}  # b: a published head with no time log
    table = "\n".join(results_page.train_table(record))
    assert "| a | 400 | 62.1 min | 25.3 min | 1.50 GiB | 1.70 | 0.70 |" in table
    assert "| b | 10 | - | - | - | 1.20 |  |" in table
    with pytest.raises(ValueError, match="not a /usr/bin/time -v log"):
        (tmp_path / "bad.time").write_text("Traceback ...")
        time_log(tmp_path / "bad.time")


def test_a_table_lists_its_commands_shared_words_once() -> None:
    base = "python scripts/benchmark.py --target T --method eagle3 --draft"
    lines = results_page.command_list({"a": f"{base} A --k 4 --out runs/a", "b": f"{base} B --k 5 --out runs/b"})
    assert lines[0] == "Commands (each `headstart bench --target T --method eagle3 FLAGS` (each with its own --out)):"
    assert lines[2:] == ["- a: `--draft A --k 4`", "- b: `--draft B --k 5`"]  # a flag keeps its value
    ends = results_page.command_list({"a": "torchrun x.py --config c.yaml --e 6 --quiet",
                                      "b": "torchrun x.py --config c.yaml --e 10 --quiet"})
    assert ends == ["Commands (each `torchrun x.py --config c.yaml FLAGS --quiet`):", "", "- a: `--e 6`", "- b: `--e 10`"]
    one = results_page.command_list({"a": f"{base} A"})
    assert one == ["Commands:", "", "- a: `headstart bench --target T --method eagle3 --draft A`"]
    apart = results_page.command_list({"a": "python x.py --a 1", "b": "bash y.sh"})
    assert apart[2:] == ["- a: `python x.py --a 1`", "- b: `bash y.sh`"]


def test_a_published_heads_time_comes_from_the_result_file_that_timed_its_run(tmp_path: Path) -> None:
    from headstart.benchmarks.heads_side_by_side import times_from, train_run

    head, other = tmp_path / "head", tmp_path / "other"
    for d, out, batch in ((head, "runs/x", 4), (other, "runs/never-timed", 8)):
        d.mkdir()
        (d / "eval_metrics.json").write_text(json.dumps({
            "evals": [{"split": "eval", "step": 9, "sim_accept_len": 2.0, "acc_0": 0.5}],
            "run_config": {"output_dir": out, "data": {"files": ["data/a.jsonl"]}, "train": {"batch_size": batch}}}))
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"train": {"x": {"run": "runs/x", "wall_s": 600.0, "peak_rss_gib": 1.0}}}))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"plan": []}))  # a result file with no training runs is read past
    train = {"head": train_run(head, None), "other": train_run(other, None)}
    times_from(train, [plan, earlier])
    assert train["head"]["wall_s"] == 600.0 and train["head"]["times_from"] == "earlier.json"
    assert "wall_s" not in train["other"]
    table = "\n".join(results_page.train_table({"train": train}))
    assert "| head | a.jsonl | 4 a rank | 9 | 10.0 min (earlier.json) | 1.00 GiB | 2.00 | 0.50 |" in table
    assert "| other | a.jsonl | 8 a rank | 9 | - | - | 2.00 | 0.50 |" in table
    # Runs that share their data and batch say so once, above a table without those columns.
    train["other"]["train"]["batch_size"] = 4
    table = "\n".join(results_page.train_table({"train": train}))
    assert "Every run: data a.jsonl; sequences / step 4 a rank." in table
    assert "| head | 9 | 10.0 min (earlier.json) | 1.00 GiB | 2.00 | 0.50 |" in table and "a.jsonl |" not in table


def test_a_paired_table_lists_each_baseline_once_and_only_the_commands_its_rows_do_not_say(tmp_path: Path) -> None:
    """Two runs paired with the same baseline (same drafter, head, shape and acceptance): the baseline is one row under
    the table with its speed-up in each pair; a chain's command is what its row and baseline say, so only the tree's
    is listed."""
    record = bench_record("targets/A", 2.0)
    base = "python scripts/benchmark.py --target targets/A --questions q.jsonl"
    first, second = record["bench"]["ngram"]["first"], dict(record["bench"]["ngram"]["first"], method="eagle3", draft="h")
    record["bench"] = {}
    for name, shape, flags, speed in (("k4", "chain k=4", "--num-speculative-tokens 4", 1.1),
                                      ("tree", "dynamic tree depth 2 top-k 2 4 tokens", "--tree", 1.3)):
        rival = f"--versus '--method eagle3 --draft h {flags}'"
        record["bench"][name] = {
            "first": dict(first, shape=shape, command=f"{base} --method ngram {flags} {rival} --out runs/{name} --overwrite"),
            "second": dict(second, shape="chain k=4", speedup=speed), "paired": {"turns": 16, "tokens_per_s_ratio": 0.9}}
    (tmp_path / "a.json").write_text(json.dumps(record))
    text = results_page.render(results_page.load(tmp_path))
    shown = base.replace("python scripts/benchmark.py", "headstart bench")
    assert f"Every table below decoded {first['conditions']}, greedy: `{shown} FLAGS`." in text
    assert text.count("| eagle3 | `h` | chain k=4 | 2.00 |") == 1 and "| 1.10-1.30x (2 pairs) |" in text
    assert "| k4 | ngram | `-` | chain k=4 | 2.00 | 0.50 0.25 | 0.1 / 0.0 / 5.0 | 1.25x (1.30x) | 0.90x |" in text
    assert ("Commands: FLAGS as the rows say, but:\n\n- tree: `--method ngram --tree --versus '--method eagle3 --draft h "
            "--tree'`") in text


def test_tau_by_category_renders_drafter_against_baseline_one_table_per_question_file() -> None:
    """Runs collected with --by-category carry tau per question category (the benchmark's own split), and the page
    shows them, the drafter against its pair's baseline, one table per set of categories; runs without stay out."""
    from headstart.benchmarks.heads_side_by_side import by_category

    report = {"results": {"gsm8k": {"tau": 1.5}, "codegen": {"tau": 2.25}, "overall": {"tau": 1.9}}}
    assert by_category(report) == {"gsm8k": 1.5, "codegen": 2.25}
    record = bench_record("targets/A", 2.0)
    run = record["bench"]["ngram"]["first"]
    record["bench"] = {
        "heldout": {"first": dict(run, method="suffix", tau_by_category={"gsm8k": 1.5, "codegen": 2.25},
                                  conditions="heldout.jsonl (all, every turn), 128 new tokens"),
                    "second": dict(run, tau_by_category={"gsm8k": 1.75, "codegen": 1.25}),
                    "paired": {"turns": 8, "tokens_per_s_ratio": 0.9}},
        "mt": {"first": dict(run, method="suffix", tau_by_category={"writing": 1.0},
                             conditions="mt_bench.jsonl (first 1 per category, every turn)")},
        "plain": {"first": run}}
    text = "\n".join(results_page.bench_table(record))
    assert "| run | gsm8k | codegen |\n|---|---|---|\n| heldout | 1.50 / 1.75 | 2.25 / 1.25 |" in text
    assert "| run | writing |\n|---|---|\n| mt | 1.00 |" in text
    assert text.count("tau by question category") == 2 and "| plain | 1" not in text.split("tau by question category")[1]
    assert "tau by question category of heldout.jsonl (" in text and "tau by question category of mt_bench.jsonl (" in text


def test_two_verification_rules_render_head_by_head_with_the_gain_over_seeds(tmp_path: Path) -> None:
    """benchmarks/verification_gain.py's rows from paired runs: tau under each rule by seed, the gain's mean and
    spread, the paired ratio; the page shows them under the target's section with its bench tables."""
    from headstart.benchmarks.verification_gain import head_rows, spread

    def run(tau: float, base: float, ratio: float, draft: str = "configs/demo/eagle3-head") -> dict:
        side = lambda t, mode: {"method": "eagle3", "draft": draft, "shape": "chain k=4", "target": "targets/A",  # noqa: E731
                                "conditions": "mt_bench.jsonl (first 1 per category, every turn), 128 new tokens",
                                "mode": mode, "tau": t, "acceptance_by_position": [0.5], "command": "headstart bench --seed 0",
                                "mean_logprob": -1.0 - t, "plain_mean_logprob": -2.0}
        return {"first": side(tau, "sampling T=0.7, block verification"), "second": side(base, "sampling T=0.7"),
                "paired": {"turns": 16, "tokens_per_s_ratio": ratio}}

    heads = head_rows({"eagle3@0": run(2.2, 2.0, 1.05), "eagle3@1": run(2.1, 2.0, 1.01), "eagle3@2": run(2.0, 2.0, 0.99)})
    row = heads["eagle3"]
    assert row["seeds"] == [0, 1, 2] and row["gain_pct"] == [10.0, 5.0, 0.0]
    assert row["gain"] == {"mean": 5.0, "sd": 5.0}
    record = {"title": "Block verification against token verification", "what": "block vs token", "target": "targets/A",
              "command": "x", "commit": "abc", "machine": "CPU", "date": "2026-12-02T00:00:00+00:00",
              "verification": {"rule": "block verification", "baseline": "token verification", "heads": heads,
                               "gain_over_heads": spread([5.0])}}
    (tmp_path / "v.json").write_text(json.dumps(record))
    (tmp_path / "a.json").write_text(json.dumps(bench_record("targets/A", 1.875)))
    text = results_page.render(results_page.load(tmp_path))
    assert "| `configs/demo/eagle3-head` | eagle3 | chain k=4 | 2.00 / 2.00 / 2.00 | 2.20 / 2.10 / 2.00 | +5.0% (5.0) | " \
           "1.05x / 1.01x / 0.99x | -3.100 / -3.000 / -2.000 |" in text
    assert text.index("## `targets/A` on CPU") < text.index("### Block verification against token verification")
    assert "Command (M, D: a row's drafter and head; S: its seed): `headstart bench --seed S`." in text
    with pytest.raises(SystemExit, match="one head under two rules"):
        head_rows({"x@0": run(2.0, 2.0, 1.0) | {"second": {**run(2.0, 2.0, 1.0)["second"], "draft": "other"}}})


def test_each_target_shows_its_drafts_side_by_side_and_links_its_two_comparisons_pages(tmp_path: Path) -> None:
    headline, study, trained = bench_record("targets/A", 1.5), bench_record("targets/A", 2.25), bench_record("targets/A", 2.75)
    headline["title"], study["title"], trained["title"] = "All trained drafts side by side", "n-gram at two budgets", "k heads"
    trained["train"] = {"k2": {"step": 10, "sim_accept_len": 1.625, "acc_by_step": [0.5]}}
    results = tmp_path / "results"
    results.mkdir()
    for name, record in (("a_all_drafts", headline), ("budgets", study), ("heads", trained)):
        (results / f"{name}.json").write_text(json.dumps(record))
    pages = results_page.pages(results_page.load(results))
    heads, decoding = "benchmarks/pages/targets-a-cpu-heads.md", "benchmarks/pages/targets-a-cpu-decoding.md"
    assert list(pages) == ["BENCHMARKS.md", heads, decoding]
    front = pages["BENCHMARKS.md"]
    assert "1.50" in front and "2.25" not in front and "2.75" not in front
    assert f"Heads compared on this target ([{heads}]({heads})): k heads." in front
    assert f"Decoding methods compared on this target ([{decoding}]({decoding})): n-gram at two budgets." in front
    # a file that trains its heads goes on the heads page, one that decodes heads already there on the other
    assert pages[heads].startswith("# Heads compared: `targets/A` on CPU") and "1.62" in pages[heads]
    assert "2.25" in pages[decoding] and "2.75" not in pages[decoding] and "1.50" not in pages[decoding]
    # a page no result file gives any more is removed by a rewrite, and --check names it
    out = tmp_path / "BENCHMARKS.md"
    assert results_page.main(["--results", str(results), "--out", str(out)]) == 0
    old = tmp_path / "benchmarks" / "pages" / "targets-a-cpu.md"
    old.write_text("a page from before\n")
    assert results_page.main(["--check", "--results", str(results), "--out", str(out)]) == 1
    assert results_page.main(["--results", str(results), "--out", str(out)]) == 0
    assert not old.exists() and (tmp_path / heads).is_file()
    assert results_page.main(["--check", "--results", str(results), "--out", str(out)]) == 0


def test_a_run_cannot_append_its_table_to_a_generated_page() -> None:
    from headstart.decode.report import append_section

    for page in (ROOT / "BENCHMARKS.md", ROOT / "benchmarks" / "pages" / "any.md"):
        with pytest.raises(ValueError, match="is generated from benchmarks/results/"):
            append_section(page, "title", "body")


def test_an_online_stream_renders_tau_and_speed_over_all_of_it_and_its_last_half(tmp_path: Path) -> None:
    """The learner's row is computed from each turn's [counted tokens, forwards, tokens, seconds]: the last half of a
    stream where the learner catches up shows its gain and its speed there, not diluted by the first half; its
    settings are read from the stream's command (the recipe's rate where it gave no --online-lr)."""
    from headstart.benchmarks.online_shift import learner_row, learning_settings
    from headstart.trainer.config import TrainConfig

    frozen = {"turns": [[10, 10, 10, 1.0]] * 4, "results": {"overall": {}}}
    # first half: the same tau, slower (the updates); last half: twice the tokens per forward, and faster
    online = {"turns": [[10, 10, 10, 1.25]] * 2 + [[20, 10, 20, 1.0]] * 2, "results": {"overall": {"learn_ms_per_token": 5.0}},
              "mode": "greedy, online"}
    row = learner_row(frozen, online, original_after=3.9, original_before=4.0)
    assert row["last_half_vs_frozen"] == pytest.approx(2.0) and row["tau"] == pytest.approx(60 / 40)
    assert row["speed_vs_frozen"] == pytest.approx((60 / 4.5) / 10) and row["last_half_speed_vs_frozen"] == pytest.approx(2.0)
    assert row["original_change"] == pytest.approx(-0.025)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  lr: 0.003\n")
    stream = "headstart bench --method eagle3 --versus '--method eagle3 --online --online-every {} --online-steps 1 " \
             "--online-recipe {} {}' --out o"
    assert learning_settings(stream.format(4, recipe, "--online-lr 3e-4 --online-replay t.jsonl")) == {
        "lr": 3e-4, "every": 4, "steps": 1, "replay": True}
    assert learning_settings(stream.format(8, recipe, "")) == {"lr": 0.003, "every": 8, "steps": 1, "replay": False}
    bare = "headstart bench --versus '--method eagle3 --online --online-every 2 --online-steps 3' --out o"
    assert learning_settings(bare)["lr"] == TrainConfig().lr  # no recipe: the recipe defaults' rate
    record = {"title": "t", "what": "w", "suite": "s", "file": "f.json", "command": "c", "commit": "abc",
              "machine": "CPU x86_64, 2 cores", "date": "2026-12-03T00:00:00+00:00",
              "online": {"requests": 4, "window": 20, "original_questions": 3, "learning": "lr3e-4-every4",
                         "runs": {"frozen": learner_row(frozen, frozen, 4.0, 4.0),
                                  "lr3e-4-every4": {**row, "lr": 3e-4, "every": 4, "replay": True},
                                  "lr1e-3-every8": {**row, "lr": 1e-3, "every": 8, "replay": False}}}}
    text = "\n".join(results_page.online_section(record))
    assert ("| `--online`, replaying its training data | 0.0003, 4 | 1.50 | 2.00 | 2.00x | 1.33x / 2.00x | 5.00 ms/token "
            "| 3.90 (-2.5%) |") in text
    assert "| `--online`, the served traffic alone | 0.001, 8 |" in text
    # the windows of the suite's own setting only
    assert "frozen 1.00; `--online`, replaying its training data 1.50. Mode" in text and "alone 1.50" not in text
