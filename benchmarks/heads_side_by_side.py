"""Heads side by side: one result file from finished training runs and paired ``headstart bench`` runs.

    python benchmarks/heads_side_by_side.py --title "P-EAGLE and EAGLE-3" --what "P-EAGLE vs EAGLE-3, quick-start recipe" \\
        --train eagle3=runs/pe-demo/eagle3:runs/pe-demo/eagle3.time --train peagle=runs/pe-demo/peagle:runs/pe-demo/peagle.time \\
        --bench k4=runs/pe-demo/bench-k4 --out benchmarks/results/peagle_vs_eagle3.json

A training run gives its command (run_config.json), the last evaluation's simulated acceptance length and top-1
accuracy by step, and, from a GNU ``/usr/bin/time -v`` log of the run, its wall time and peak resident memory (the
largest process: one rank). A bench directory (``headstart bench``, with ``--versus`` a pair) gives, for both methods, tau,
acceptance by position, the round clock (draft, drafter update, verify ms per round), tokens/s, predicted and
measured speed-up, and the paired ratio by turn. Nothing is re-measured here: the file records the runs' numbers.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from headstart.benchmarks.record import write_result


def time_log(path: Path) -> dict[str, float]:
    """Wall seconds, CPU seconds (user + system, every process of the run: what sharing the machine with other work
    does not inflate as it does the wall time), peak RSS (GiB) and the command from ``/usr/bin/time -v`` output."""
    text = path.read_text()
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", text)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    if wall is None or rss is None:
        raise ValueError(f"{path}: not a /usr/bin/time -v log (no wall clock or maximum resident set size line)")
    seconds = 0.0
    for part in wall.group(1).split(":"):
        seconds = seconds * 60 + float(part)
    timed = re.search(r'Command being timed: "(.*)"', text)
    cpu = [re.search(rf"{kind} time \(seconds\): ([\d.]+)", text) for kind in ("User", "System")]
    return {"wall_s": round(seconds, 1), "peak_rss_gib": round(int(rss.group(1)) / 2**20, 2),
            **({"cpu_s": round(sum(float(m.group(1)) for m in cpu), 1)} if all(cpu) else {}),
            **({"command": timed.group(1)} if timed else {})}


def train_run(directory: Path, log: Path | None) -> dict:
    """A run directory (metrics.jsonl, run_config.json) or a published head (its card's eval_metrics.json)."""
    if (directory / "metrics.jsonl").is_file():
        records = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines() if line.strip()]
        config = json.loads((directory / "run_config.json").read_text())
    else:
        card = json.loads((directory / "eval_metrics.json").read_text())
        records, config = card["evals"], card.get("run_config", {})
    evals = [r for r in records if r.get("split") == "eval"]
    if not evals:
        raise ValueError(f"{directory}: no evaluation record (metrics.jsonl, or a published head's eval_metrics.json)")
    last = evals[-1]
    acc = [round(last[f"acc_{s}"], 3) for s in range(64) if f"acc_{s}" in last]
    data = config.get("data") or {}
    return {"run": str(directory), "step": last.get("step"), "sim_accept_len": round(last["sim_accept_len"], 3),
            "acc_by_step": acc, "draft": config.get("draft"), "train": config.get("train"),
            **({"data": [Path(f).name for f in data["files"]]} if data.get("files") else {}),
            **(time_log(log) if log else {})}


def times_from(train: dict[str, dict], files: list[Path]) -> None:
    """A published head's training time, from an earlier result file that timed the run it was published from (its
    card's ``output_dir``): wall, CPU and peak copied with the file named (``times_from``), nothing re-measured."""
    timed = {}
    for f in files:
        for run in json.loads(f.read_text()).get("train", {}).values():  # a plan comparison has none
            if "wall_s" in run:
                timed.setdefault(run["run"], (f, run))
    for record in train.values():
        card = Path(record["run"]) / "eval_metrics.json"
        source = json.loads(card.read_text()).get("run_config", {}).get("output_dir") if card.is_file() else None
        if source in timed:
            f, run = timed[source]
            record.update({k: run[k] for k in ("wall_s", "cpu_s", "peak_rss_gib", "command") if k in run},
                          times_from=f.name)


def conditions(args: dict, machine: str) -> str:
    """What was decoded and how: the questions, how many of them, the new tokens, the dtype and batch."""
    which = (f"first {args['per_category']} per category" if args.get("per_category") else
             f"first {args['limit']}" if args.get("limit") else "all")
    dtype = args.get("dtype") or ("float32" if machine.startswith("CPU") else "bfloat16")  # the benchmark's default
    return (f"{Path(args['questions']).name} ({which}, every turn), {args['max_new_tokens']} new tokens, {dtype}, "
            f"batch {args.get('batch_size', 1)}")


def by_category(report: dict) -> dict[str, float]:
    """tau per question category (the benchmark's own split of its results): where copying from earlier text wins
    shows per category, not in the mean."""
    return {name: round(r["tau"], 3) for name, r in report["results"].items() if name != "overall"}


def method(report: dict, categories: bool = False) -> dict:
    o, args = report["results"]["overall"], report["args"]
    return {"method": args["method"], "draft": args.get("draft"), "target": args["target"],
            "shape": report.get("shape", f"chain k={args['num_speculative_tokens']}"),
            "mode": report.get("mode", "greedy"), "conditions": conditions(args, report["machine"]),
            "k": args["num_speculative_tokens"], "tau": round(o["tau"], 3),
            "acceptance_by_position": [round(a, 3) for a in o["acceptance_by_position"] if a is not None],
            **({"drafts_per_round": round(o["drafts_per_round"], 2)} if o.get("drafts_per_round") is not None else {}),
            **({"rounds_cut": round(o["rounds_cut"], 3)} if o.get("rounds_cut") is not None else {}),
            "round_ms": {k: round(v, 2) for k, v in o["round_ms"].items()}, "tokens_per_s": round(o["spec_tokens_per_s"], 2),
            "plain_tokens_per_s": round(o["plain_tokens_per_s"], 2), "speedup": round(o["speedup"], 3),
            "predicted_speedup": round(o["predicted_speedup"], 3), "command": report.get("command"),
            **({"mean_logprob": round(o["mean_logprob"], 4), "plain_mean_logprob": round(o["plain_mean_logprob"], 4)}
               if o.get("mean_logprob") is not None else {}),
            **({"tau_by_category": by_category(report)} if categories else {})}


def bench_run(directory: Path, categories: bool = False) -> dict:
    first = json.loads((directory / "results.json").read_text())
    out = {"first": method(first, categories)}
    if first.get("versus_out"):
        out["second"] = method(json.loads((Path(first["versus_out"]) / "results.json").read_text()), categories)
        paired = first["paired"]
        out["paired"] = {"turns": paired["turns"], "tokens_per_s_ratio": round(paired["overall_ratio"], 3),
                         "median_ratio": round(paired["median_ratio"], 3)}
    if first.get("prediction"):
        out["first"]["predicted_rows"] = first["prediction"]["rows"]
    return out


def pairs(values: list[str], what: str) -> dict[str, str]:
    out = {}
    for value in values:
        name, sep, rest = value.partition("=")
        if not sep:
            raise SystemExit(f"--{what} {value!r}: expected NAME=PATH")
        out[name] = rest
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--title", required=True, help="the results page's heading for this file (a few words)")
    p.add_argument("--what", required=True, help="one line: what is compared, on which data, steps and batch")
    p.add_argument("--train", action="append", default=[], metavar="NAME=RUN_DIR[:TIME_LOG]")
    p.add_argument("--train-command", action="append", default=[], metavar="NAME=COMMAND",
                   help="the command of a training run whose time log does not record it (a published head)")
    p.add_argument("--bench", action="append", default=[], metavar="NAME=BENCH_DIR")
    p.add_argument("--times-from", action="append", default=[], type=Path, metavar="RESULT_FILE",
                   help="earlier result files whose timed training runs the --train heads were published from")
    p.add_argument("--by-category", action="store_true", help="record each decoding run's tau per question category")
    p.add_argument("--out", required=True)
    p.add_argument("--allow-dirty", action="store_true",
                   help="write into benchmarks/results/ from a checkout with uncommitted changes (the file says so)")
    args = p.parse_args()
    train = {}
    for name, value in pairs(args.train, "train").items():
        run, _, log = value.partition(":")
        train[name] = train_run(Path(run), Path(log) if log else None)
    for name, command in pairs(args.train_command, "train-command").items():
        train[name]["command"] = command
    times_from(train, args.times_from)
    bench = {name: bench_run(Path(d), args.by_category) for name, d in pairs(args.bench, "bench").items()}
    write_result(args.out, {"title": args.title, "what": args.what, "train": train, "bench": bench}, args.allow_dirty)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
