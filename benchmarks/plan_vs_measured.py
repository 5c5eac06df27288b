"""headstart plan against measured peaks: for each finished training run, the plan of its recipe (same overrides, same
number of ranks) next to the peak resident memory GNU time measured for its largest process, in one result file.

    python benchmarks/plan_vs_measured.py --title "headstart plan against measured peaks (CPU)" \\
        --run "configs/demo/eagle31_regenerated.yaml:1:runs/new-heads-full/eagle31.time:runs/demo-eagle31-regenerated:--train.batch_size=8" \\
        --out benchmarks/results/plan_vs_measured_cpu.json

Each --run is RECIPE:RANKS:TIME_LOG:RUN_DIR[:OVERRIDES] (overrides space-separated, as the run was given them). The
plan is given twice: with micro-batches as full as the recipe allows (its bound, what ``headstart plan`` prints) and
with the run's largest logged micro-batch (RUN_DIR/metrics.jsonl), when the data's conversations are shorter. Nothing
is re-measured here: the time logs and metrics are the runs'.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from headstart.benchmarks.heads_side_by_side import time_log
from headstart.benchmarks.record import write_result
from headstart.decode.report import machine
from headstart.trainer.config import load_config
from headstart.trainer.plan import GIB, plan


def largest_micro_batch(run: Path, ranks: int) -> int:
    """The most tokens a logged step held, per rank and micro-batch (metrics.jsonl adds them over ranks)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if r.get("split") == "train"]
    if not steps:
        raise ValueError(f"{run}/metrics.jsonl has no train record")
    accum = json.loads((run / "run_config.json").read_text())["train"]["grad_accum"]
    return int(max(r["tokens"] for r in steps) / ranks / accum)


def row(spec: str) -> dict:
    recipe, ranks, log, run, *rest = spec.split(":", 4)
    overrides, ranks = (rest[0].split() if rest else []), int(ranks)
    measured = time_log(Path(log))
    config = load_config(recipe, overrides)
    device = "cpu" if machine().startswith("CPU") else "cuda"
    tokens = largest_micro_batch(Path(run), ranks)
    bound, actual = plan(config, ranks, device=device), plan(config, ranks, device=device, tokens=tokens)
    gib = measured["peak_rss_gib"]
    return {"recipe": recipe, "ranks": ranks, "overrides": overrides, "command": measured.get("command"),
            "measured_gib": gib, "planned_gib": round(bound.total / GIB, 2), "ratio": round(bound.total / GIB / gib, 3),
            "bound_tokens": bound.tokens_per_micro_batch, "run_tokens": tokens,
            "planned_at_run_tokens_gib": round(actual.total / GIB, 2),
            "ratio_at_run_tokens": round(actual.total / GIB / gib, 3),
            "parts_gib": {name: round(size / GIB, 3) for name, size in bound.parts}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--title", required=True)
    p.add_argument("--run", action="append", required=True, metavar="RECIPE:RANKS:TIME_LOG:RUN_DIR[:OVERRIDES]")
    p.add_argument("--out", required=True)
    p.add_argument("--allow-dirty", action="store_true",
                   help="write into benchmarks/results/ from a checkout with uncommitted changes (the file says so)")
    args = p.parse_args(argv)
    rows = [row(spec) for spec in args.run]
    what = ("headstart plan's per-process peak for each recipe, against the peak resident memory of the largest "
            "training process (GNU time) of a run of it")
    write_result(args.out, {"title": args.title, "what": what, "plan": rows}, args.allow_dirty)
    for r in rows:
        print(f"{r['recipe']} x{r['ranks']}: measured {r['measured_gib']} GiB; planned {r['planned_gib']} GiB at "
              f"{r['bound_tokens']} tokens ({r['ratio']:.2f}x), {r['planned_at_run_tokens_gib']} GiB at {r['run_tokens']} "
              f"({r['ratio_at_run_tokens']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
