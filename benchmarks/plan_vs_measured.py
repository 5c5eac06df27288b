"""headstart plan against measured peaks: for each finished training run, the plan of its recipe (same overrides, same
number of ranks) next to the peak resident memory GNU time measured for its largest process, in one result file.

    python benchmarks/plan_vs_measured.py --title "headstart plan against measured peaks (CPU)" \\
        --run "configs/demo/eagle31_regenerated.yaml:1:runs/new-heads-full/eagle31.time:--train.batch_size=8" \\
        --out benchmarks/results/plan_vs_measured_cpu.json

Each --run is RECIPE:RANKS:TIME_LOG[:OVERRIDES] (overrides space-separated, as the run was given them). Nothing
is re-measured here: the time logs are the runs'.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from headstart.benchmarks.heads_side_by_side import time_log
from headstart.decode.report import machine, provenance
from headstart.trainer.config import load_config
from headstart.trainer.plan import GIB, plan


def row(spec: str) -> dict:
    recipe, ranks, log, *rest = spec.split(":", 3)
    overrides = rest[0].split() if rest else []
    measured = time_log(Path(log))
    planned = plan(load_config(recipe, overrides), int(ranks), device="cpu" if machine().startswith("CPU") else "cuda")
    return {"recipe": recipe, "ranks": int(ranks), "overrides": overrides, "command": measured.get("command"),
            "planned_gib": round(planned.total / GIB, 2), "measured_gib": measured["peak_rss_gib"],
            "ratio": round(planned.total / GIB / measured["peak_rss_gib"], 3),
            "parts_gib": {name: round(size / GIB, 3) for name, size in planned.parts}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--title", required=True)
    p.add_argument("--run", action="append", required=True, metavar="RECIPE:RANKS:TIME_LOG[:OVERRIDES]")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    rows = [row(spec) for spec in args.run]
    what = ("headstart plan's per-process peak for each recipe, against the peak resident memory of the largest "
            "training process (GNU time) of a run of it")
    Path(args.out).write_text(json.dumps({"title": args.title, "what": what, **provenance(), "plan": rows}, indent=1) + "\n")
    for r in rows:
        print(f"{r['recipe']} x{r['ranks']}: planned {r['planned_gib']} GiB, measured {r['measured_gib']} GiB "
              f"({r['ratio']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
