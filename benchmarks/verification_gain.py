"""One verification rule against another, head by head over seeds: one result file from paired ``headstart bench`` runs.

    python benchmarks/verification_gain.py --title "Block verification against token verification" \\
        --what "..." --rule "block verification" --bench eagle3@0=runs/verification/eagle3-s0 \\
        --bench eagle3@1=runs/verification/eagle3-s1 --out benchmarks/results/block_verification_demo.json

Each ``--bench HEAD@SEED=DIR`` is a run decoded with one rule (``--verification block``) paired in one process with
the same head under another (``--versus '... --verification token'``, ``--baseline``), both sampling from the same
seed. The file records, per head, each seed's tau under both rules, the gain (the rule's over the baseline's, in
percent) with its mean and spread over the seeds, the paired tokens/s ratio, and the mean target log-probability of
the sampled text under each rule and plain sampling (decode/quality.py: what a rule that is not lossless costs); and
the mean gain over the heads. Nothing is re-measured here.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from headstart.benchmarks.heads_side_by_side import bench_run, pairs
from headstart.benchmarks.record import write_result


def spread(values: list[float]) -> dict[str, float]:
    """Mean and sample standard deviation (0 for one value), rounded for the page."""
    return {"mean": round(statistics.fmean(values), 2), "sd": round(statistics.stdev(values), 2) if len(values) > 1 else 0.0}


def head_rows(runs: dict[str, dict]) -> dict[str, dict]:
    """``runs`` by ``HEAD@SEED`` (heads_side_by_side ``bench_run``) -> per head: its rule's and the baseline's tau by
    seed, the gain in percent by seed with its mean and spread, the paired tokens/s ratios."""
    heads: dict[str, dict] = {}
    for key, run in runs.items():
        head, _, seed = key.rpartition("@")
        if not head or "second" not in run:
            raise SystemExit(f"--bench {key}: expected HEAD@SEED=DIR of a run paired with --versus")
        first, second = run["first"], run["second"]
        if (first["method"], first["draft"], first["shape"]) != (second["method"], second["draft"], second["shape"]):
            raise SystemExit(f"--bench {key}: the pair decodes two drafters or shapes; it must be one head under two rules")
        row = heads.setdefault(head, {"method": first["method"], "draft": first["draft"], "shape": first["shape"],
                                      "target": first["target"], "conditions": first["conditions"], "mode": first["mode"],
                                      "baseline_mode": second["mode"], "seeds": [], "tau": [], "baseline_tau": [],
                                      "acceptance_by_position": [], "baseline_acceptance_by_position": [],
                                      "tokens_per_s_ratio": [], "mean_logprob": [], "baseline_mean_logprob": [],
                                      "plain_mean_logprob": [], "commands": []})
        row["seeds"].append(int(seed))
        row["tau"].append(first["tau"])
        row["baseline_tau"].append(second["tau"])
        row["acceptance_by_position"].append(first["acceptance_by_position"])
        row["baseline_acceptance_by_position"].append(second["acceptance_by_position"])
        row["tokens_per_s_ratio"].append(run["paired"]["tokens_per_s_ratio"])
        row["commands"].append(first["command"])
        if "mean_logprob" in first:
            row["mean_logprob"].append(first["mean_logprob"])
            row["baseline_mean_logprob"].append(second["mean_logprob"])
            row["plain_mean_logprob"].append(first["plain_mean_logprob"])
    for row in heads.values():
        row["gain_pct"] = [round(100 * (a / b - 1), 2) for a, b in zip(row["tau"], row["baseline_tau"])]
        row["gain"] = spread(row["gain_pct"])
    return heads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--title", required=True)
    p.add_argument("--what", required=True, help="one line: the rules, heads, data, seeds")
    p.add_argument("--rule", required=True, help="the runs' rule as the page names it, e.g. 'block verification'")
    p.add_argument("--baseline", default="token verification", help="their --versus runs' rule")
    p.add_argument("--bench", action="append", default=[], metavar="HEAD@SEED=BENCH_DIR")
    p.add_argument("--out", required=True)
    p.add_argument("--allow-dirty", action="store_true",
                   help="write into benchmarks/results/ from a checkout with uncommitted changes (the file says so)")
    args = p.parse_args()
    heads = head_rows({name: bench_run(Path(d)) for name, d in pairs(args.bench, "bench").items()})
    if not heads:
        raise SystemExit("no --bench runs: nothing to compare")
    targets = {row["target"] for row in heads.values()}
    if len(targets) != 1:
        raise SystemExit(f"one target per result file, found {sorted(targets)}")
    record = {"title": args.title, "what": args.what, "target": targets.pop(),
              "verification": {"rule": args.rule, "baseline": args.baseline, "heads": heads,
                               "gain_over_heads": spread([r["gain"]["mean"] for r in heads.values()])}}
    out = write_result(args.out, record, allow_dirty=args.allow_dirty)
    print(f"wrote {args.out}: " + "; ".join(f"{h} {r['gain']['mean']:+.1f}% (sd {r['gain']['sd']:.1f})"
                                            for h, r in out["verification"]["heads"].items()))


if __name__ == "__main__":
    main()
