"""Kill anywhere: SIGKILL a job at seeded random moments and at the moments it writes (a checkpoint,
the best head, the final head, a feature shard, the manifest, a regenerated shard), resume it with
``--resume`` after every kill, and compare what it ends with against an uninterrupted run.

    python benchmarks/soak_kill.py --config configs/demo/eagle3.yaml --rows 256 --kills 8 --seed 0 \
        --table runs/soak.md

Three jobs, each on ``--rows`` conversations of the recipe's first data file: 2-rank training (FSDP2,
checkpoints and evaluations every few steps so that ``best/`` is written too), the 2-rank feature job,
and ``regenerate_data.py`` (hf backend, greedy). A kill goes to the launched command and every process
under it at once (torchrun and its workers), as a lost node loses them. tests/test_soak.py runs the same on a tiny target.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from headstart.models.export import HOLD_ENV
from headstart.trainer.run_dir import MACHINE_METRICS
from headstart.benchmarks.record import write_table

REPO = Path(__file__).resolve().parents[1]
TIMING = MACHINE_METRICS  # the metrics that depend on the clock and the machine


@dataclass(frozen=True)
class Kill:
    """``after`` seconds from the launch, or (``path`` set) the moment a file matching it appears."""

    after: float
    path: str | None = None

    def describe(self) -> str:
        return f"while writing {self.path}" if self.path else f"at {self.after:.1f} s"


def plan_kills(n: int, seed: int, writing: list[str], window: tuple[float, float]) -> list[Kill]:
    """n kills: each of the ``writing`` moments once, in the order a run reaches them, the rest at seeded random
    times placed at random among them but before the last (after a kill in the final export nothing is left to
    run for a random kill to land in)."""
    rng = random.Random(seed)
    kills = [Kill(0.0, p) for p in writing[:n]]
    for _ in range(max(0, n - len(writing))):
        kills.insert(rng.randint(0, max(0, len(kills) - 1)), Kill(round(rng.uniform(*window), 1)))
    return kills


TAG = "HEADSTART_SOAK_LAUNCH"
"""An environment variable every process of a launch inherits (torchrun passes its environment on): how a kill
finds them all, whatever session they are in and even while the launcher is still starting its workers."""


def _launch(argv: list[str], log: Path) -> subprocess.Popen:
    # HOLD_ENV: exports wait 50 ms before their rename, so the 2 ms watcher reliably sees a tiny head's write
    # (about a millisecond otherwise) and kills inside it.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", TAG: f"{os.getpid()}-{time.monotonic_ns()}",
           HOLD_ENV: "0.05"}
    with log.open("a") as f:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    proc.tag = env[TAG]
    return proc


def _tagged(tag: str) -> list[int]:
    """Processes whose environment carries ``tag``: torchrun starts its workers in sessions of their own, so a
    kill of its process group alone would leave them training (and writing) beside the resumed run."""
    needle = f"{TAG}={tag}".encode() + b"\0"
    pids = []
    for environ in glob.glob("/proc/[0-9]*/environ"):
        try:
            if needle in Path(environ).read_bytes():
                pids.append(int(environ.split("/")[2]))
        except OSError:
            continue  # exited meanwhile, or not ours
    return pids


def _kill_all(proc: subprocess.Popen) -> None:
    """SIGKILL the launched command and every process it started, as a lost node loses them; again until none is
    left (a launcher may be starting a worker while the first ones die)."""
    while True:
        pids = [p for p in _tagged(proc.tag) if p != os.getpid()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
        proc.poll()  # reap the launcher so it does not linger as a zombie with our tag
    proc.wait()


def run_with_kills(argv: list[str], out: Path, kills: list[Kill], log: Path, timeout: float = 900) -> list[str]:
    """Run ``argv`` (which writes into ``out``), killing it as ``kills`` say and relaunching it with
    --resume after each; then once more to the end. Returns what each kill hit."""
    hits = []
    for i, kill in enumerate([*kills, None]):
        proc = _launch(argv + (["--resume"] if i else []), log)
        start = time.monotonic()
        stale = set(glob.glob(str(out / kill.path))) if kill is not None and kill.path else set()  # left by a kill
        while proc.poll() is None:
            now = time.monotonic() - start
            if now > timeout:
                _kill_all(proc)
                raise TimeoutError(f"{argv} ran past {timeout} s; see {log}")
            if kill is not None and ((kill.path and set(glob.glob(str(out / kill.path))) - stale)
                                     or (not kill.path and now >= kill.after)):
                _kill_all(proc)
                hits.append(kill.describe() + ("" if kill.path is None else f" (after {now:.1f} s)"))
                break
            time.sleep(0.002)
        else:
            if proc.returncode != 0:
                raise RuntimeError(f"{argv} exited with {proc.returncode} after launch {i + 1}; see {log}")
            if kill is not None:
                hits.append(f"missed {kill.describe()}: the job had finished")
            break
    return hits


def metrics_without_timing(run: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def differences(a: Path, b: Path, files: list[str]) -> list[str]:
    """Files (relative to the two outputs) whose contents differ; safetensors compared tensor by tensor."""
    from safetensors.torch import load_file

    out = []
    for name in files:
        fa, fb = a / name, b / name
        if not fa.is_file() or not fb.is_file():
            out.append(f"{name}: missing in {'the uninterrupted run' if not fa.is_file() else 'the killed run'}")
        elif name.endswith(".safetensors"):
            ta, tb = load_file(str(fa)), load_file(str(fb))
            if set(ta) != set(tb) or any(not ta[k].equal(tb[k]) for k in ta):
                out.append(f"{name}: tensors differ")
        elif fa.read_bytes() != fb.read_bytes():
            out.append(f"{name}: contents differ")
    return out


def start_up_floor(job, whole: Path, log: Path) -> float:
    """Seconds a ``--resume`` launch takes when nothing is left to do (on a copy of the finished ``whole``): the
    least any launch of the killed run takes, measured warm, as every launch after the first is."""
    import shutil

    floor = whole.with_name(whole.name + "-floor")
    shutil.rmtree(floor, ignore_errors=True)
    shutil.copytree(whole, floor)
    try:
        start = time.monotonic()
        run_with_kills([*job(floor), "--resume"], floor, [], log)  # its timeout and exit-code check
        return time.monotonic() - start
    finally:
        shutil.rmtree(floor, ignore_errors=True)


def whole_and_killed(job, root: Path, name: str, kills: int, seed: int, writing: list[str],
                     window: tuple[float, float] | None) -> tuple[Path, Path, list[str]]:
    """Run ``job(out)`` uninterrupted into root/<name>-whole, then killed as planned into root/<name>-killed.
    Without ``window`` random kills fall between 10% and 50% of the start-up floor (``start_up_floor``): every
    launch lives that long, and the margin absorbs one launch running faster than the one measured. A window from
    the uninterrupted run's own time missed in CI: that run starts cold (imports, the tokenized-data cache) and
    took twice what a resumed launch took. Returns both outputs and what the kills hit."""
    whole, killed, log = root / f"{name}-whole", root / f"{name}-killed", root / f"{name}.log"
    run_with_kills(job(whole), whole, [], log)
    if window is None:
        floor = start_up_floor(job, whole, log)
        window = (0.1 * floor, 0.5 * floor)
    return whole, killed, run_with_kills(job(killed), killed, plan_kills(kills, seed, writing, window), log)


def soak_training(base: list[str], root: Path, kills: int, seed: int, window: tuple[float, float] | None = None) -> dict:
    train = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             str(REPO / "scripts" / "train_eagle3.py"), *base]
    a, b, hits = whole_and_killed(lambda out: [*train, f"--output_dir={out}"], root, "train", kills, seed,
                                  [".tmp-.best-staging", "checkpoints/.tmp-step_*", ".tmp-final"], window)
    diffs = differences(a, b, ["final/model.safetensors", "final/config.json", "best/model.safetensors", "best/best.json"])
    if metrics_without_timing(a) != metrics_without_timing(b):
        diffs.append("metrics.jsonl differs (timing left out)")
    return {"job": "training (2 ranks, FSDP2)", "kills": hits, "differences": diffs}


def soak_features(base: list[str], root: Path, kills: int, seed: int, window: tuple[float, float] | None = None) -> dict:
    job = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "scripts" / "generate_features.py"), *base]
    a, b, hits = whole_and_killed(lambda out: [*job, f"--features.path={out}"], root, "features", kills, seed,
                                  [".shard-*.safetensors.tmp"], window)
    diffs = differences(a, b, sorted(p.name for p in a.glob("shard-*.safetensors")))
    ma, mb = (json.loads((d / "manifest.json").read_text()) for d in (a, b))
    if ma["shards"] != mb["shards"] or ma["num_tokens"] != mb["num_tokens"]:
        diffs.append("manifest.json lists other shards")
    return {"job": "feature job (2 ranks)", "kills": hits, "differences": diffs}


def soak_regenerate(args: list[str], root: Path, kills: int, seed: int, window: tuple[float, float] | None = None) -> dict:
    job = [sys.executable, str(REPO / "scripts" / "regenerate_data.py"), *args, "--no-progress"]
    a, b, hits = whole_and_killed(lambda out: [*job, "--output", str(out)], root, "regen", kills, seed,
                                  ["shards/.shard-*.tmp*"], window)
    return {"job": "regenerate_data.py (hf backend)", "kills": hits, "differences": differences(a, b, ["regenerated.jsonl"])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "configs" / "demo" / "eagle3.yaml"))
    p.add_argument("--rows", type=int, default=256, help="conversations of the recipe's first data file")
    p.add_argument("--kills", type=int, default=8, help="kills per job")
    p.add_argument("--steps", type=int, default=24, help="training steps (checkpoint and evaluation every 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default="runs/soak", help="scratch directory (emptied first)")
    p.add_argument("--table", default=None, help="write the result to this markdown file")
    args = p.parse_args()
    import shutil

    import yaml

    recipe = yaml.safe_load(Path(args.config).read_text())
    root = Path(args.work).resolve()
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    source = Path(recipe["data"]["files"][0])
    rows = source.read_text().splitlines()[: args.rows] if source.suffix == ".jsonl" else None
    if rows is None:
        raise SystemExit(f"{source}: the soak takes its rows from a .jsonl file")
    data = root / "data.jsonl"
    data.write_text("\n".join(rows) + "\n")
    common = [f"--config={Path(args.config).resolve()}", f"--data.files=[{data}]", f"--data.cache_dir={root / 'cache'}",
              "--logging.progress=false"]
    train = [*common, f"--train.max_steps={args.steps}", "--train.save_every=4", "--train.eval_every=4",
             "--train.batch_size=2", "--train.eval_fraction=0.1"]
    results = [soak_training(train, root, args.kills, args.seed),
               soak_features([*common, "--features.samples_per_shard=8"], root, args.kills, args.seed),
               soak_regenerate(["--target", recipe["target"]["path"], "--data", str(data), "--limit", str(args.rows // 4),
                                "--max-new-tokens", "32", "--rows-per-shard", "2", "--batch-size", "2"],
                               root, args.kills, args.seed)]
    lines = []
    for r in results:
        verdict = "**equal** to the uninterrupted run" if not r["differences"] else "DIFFERS: " + "; ".join(r["differences"])
        lines.append(f"| {r['job']} | {len(r['kills'])} | {'; '.join(r['kills'])} | {verdict} |")
    table = "| job | kills | where each kill landed | final result |\n|---|---|---|---|\n" + "\n".join(lines)
    print(table)
    if args.table:
        write_table(args.table, "Kill anywhere: SIGKILL soak of training, the feature job and regeneration",
                       f"{args.rows} conversations of `{source}`, recipe `{args.config}`, seed {args.seed}. Every kill is a "
                       "SIGKILL of the whole process group, followed by the same command with `--resume`; compared: the "
                       "final and best heads tensor by tensor, `best.json`, `metrics.jsonl` without `tokens_per_s` and `peak_mem_gib`; "
                       "every feature shard and the manifest's shard list; `regenerated.jsonl` byte for byte.\n\n" + table)
    return 0 if all(not r["differences"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
