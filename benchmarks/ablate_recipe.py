"""Recipe ablation: train one head per variant of a recipe, then measure every head the same way.

    python benchmarks/ablate_recipe.py --config configs/demo/eagle3_full.yaml --out runs/ablation \
        --variant baseline= --variant step_weight_1=--draft.step_weight=1.0 --variant clip_1=--train.grad_clip=1.0 \
        --questions configs/demo/eval/mt_bench.jsonl --parallel 1 --benchmarks runs/lab-notes.md

A variant is NAME=OVERRIDES (space-separated ``--section.key=value``, empty for the recipe as it is);
``--common`` overrides apply to every variant (e.g. ``--common "--train.batch_size=8"`` for one process
standing in for two ranks of four). Each variant trains with ``scripts/train_eagle3.py`` into OUT/NAME
(``--parallel`` at once: several fit on one GPU), then ``scripts/benchmark.py`` measures its final head:
tau of a greedy chain of ``--k`` tokens on the first question per category, ``--max-new-tokens`` each. The
table has tau, the held-out simulated acceptance length at the last evaluation and every run's command;
``--reference NAME=DIR`` adds an existing head (e.g. the committed demo head) measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from headstart.models.head import DEFAULT_SPECULATIVE_TOKENS
from headstart.decode.report import append_section

REPO = Path(__file__).resolve().parents[1]


def train(name: str, overrides: list[str], args) -> dict:
    out = Path(args.out) / name
    cmd = [sys.executable, str(REPO / "scripts" / "train_eagle3.py"), "--config", args.config,
           f"--output_dir={out}", *shlex.split(args.common), *overrides]
    start = time.time()
    with open(Path(args.out) / f"{name}.train.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO).returncode
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
             if '"split": "eval"' in line] if (out / "metrics.jsonl").is_file() else []
    return {"name": name, "command": shlex.join(["python", "scripts/train_eagle3.py", "--config", args.config,
                                                 *shlex.split(args.common), *overrides]),
            "rc": rc, "train_s": time.time() - start, "head": str(out / "final"),
            "sim_accept_len": evals[-1]["sim_accept_len"] if evals else float("nan")}


def bench(run: dict, args) -> dict:
    if run.get("rc", 0) != 0 or not Path(run["head"]).is_dir():
        return {**run, "tau": float("nan")}
    out = Path(args.out) / f"{run['name']}.bench"
    cmd = [sys.executable, str(REPO / "scripts" / "benchmark.py"), "--target", args.target, "--method", "eagle3",
           "--draft", run["head"], "--questions", args.questions, "--per-category", "1",
           "--num-speculative-tokens", str(args.k), "--max-new-tokens", str(args.max_new_tokens),
           "--no-hf-reference", "--out", str(out)]
    with open(Path(args.out) / f"{run['name']}.bench.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO).returncode
    tau = json.loads((out / "results.json").read_text())["results"]["overall"]["tau"] if rc == 0 else float("nan")
    return {**run, "tau": tau}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--variant", action="append", default=[], help="NAME=OVERRIDES (repeat)")
    p.add_argument("--reference", action="append", default=[], help="NAME=HEAD_DIR measured alongside (repeat)")
    p.add_argument("--common", default="", help="overrides for every variant")
    p.add_argument("--target", default="configs/demo/target")
    p.add_argument("--questions", default="configs/demo/eval/mt_bench.jsonl")
    p.add_argument("--k", type=int, default=DEFAULT_SPECULATIVE_TOKENS)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--parallel", type=int, default=1)
    p.add_argument("--benchmarks", default=None)
    p.add_argument("--title", default="Recipe ablation")
    args = p.parse_args()
    variants = []
    for spec in args.variant:
        name, sep, overrides = spec.partition("=")
        if not sep or not name:
            p.error(f"--variant {spec!r}: expected NAME=OVERRIDES")
        variants.append((name, shlex.split(overrides)))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max(1, args.parallel)) as pool:
        runs = list(pool.map(lambda v: train(*v, args), variants))
        runs += [{"name": n, "command": f"(existing head {d})", "head": d, "reference": True}
                 for n, d in (r.split("=", 1) for r in args.reference)]
        results = list(pool.map(lambda r: bench(r, args), runs))
    for r in results:
        print(json.dumps(r), flush=True)
    (Path(args.out) / "ablation.json").write_text(json.dumps(results, indent=1))
    # An existing head (--reference) was not trained here: no held-out figure, no train time.
    rows = [f"| {r['name']} | {r['tau']:.2f} | "
            + ("-" if r.get("reference") else f"{r['sim_accept_len']:.3f}") + " | "
            + ("-" if r.get("reference") else f"{r['train_s']:.0f} s") + f" | `{r['command']}` |" for r in results]
    header = f"| variant | tau (chain k={args.k}) | held-out sim. accept len | train time | command |\n|---|---|---|---|---|\n"
    print(header + "\n".join(rows))
    # A variant that did not train or measure is a failed ablation, not a row of NaNs: say which, after the table,
    # and keep it out of the notes (a section of NaNs records nothing).
    ok = [r.get("rc", 0) == 0 and r["tau"] == r["tau"] for r in results]
    failed = [r["name"] for r, good in zip(results, ok) if not good]
    measured = [row for row, good in zip(rows, ok) if good]
    if args.benchmarks and measured:
        note = f"\n\nNot measured (training or benchmark failed): {', '.join(failed)}." if failed else ""
        append_section(args.benchmarks, args.title,
                       f"Each variant trained from `{args.config}` with the overrides shown, then measured with "
                       f"`scripts/benchmark.py` (first question per category of `{args.questions}`, greedy chain "
                       f"k={args.k}, {args.max_new_tokens} new tokens). Command: "
                       f"`python {shlex.join(sys.argv)}`.\n\n{header}" + "\n".join(measured) + note)
    if failed:
        print(f"failed: {', '.join(failed)} (their logs: {args.out}/NAME.train.log and NAME.bench.log)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
