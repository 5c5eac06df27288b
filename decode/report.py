"""Describe the machine and the run (a result file's provenance), and append a dated section to a notes file (the
benchmark's ``--benchmarks``, benchmarks/ drivers). BENCHMARKS.md is not such a file: benchmarks/results_page.py
generates it from result files."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch


def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    return f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"


def command() -> str:
    """The command line that is running, as a user would type it again."""
    args = " ".join(shlex.quote(a) for a in sys.argv[1:])
    if Path(sys.argv[0]).name == "headstart":  # the console script
        return f"headstart {args}"
    launcher = "torchrun --nproc_per_node " + os.environ["WORLD_SIZE"] + " " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "python "
    return launcher + " ".join([shlex.quote(sys.argv[0]), args]).strip()


def commit() -> str | None:
    """The git commit of the code that runs (``-dirty`` where tracked files differ from it), or None outside a
    git checkout (an installed package)."""
    here = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str | None:
        try:
            run = subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return run.stdout.strip() if run.returncode == 0 else None

    head = git("rev-parse", "--short=12", "HEAD")
    if head is None:
        return None
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def provenance() -> dict[str, str | None]:
    """What a result file records of the run that made it: the command, the code's commit, the machine, the time."""
    return {"command": command(), "commit": commit(), "machine": machine(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def append_section(path: str | Path, title: str, body: str, measured_on: str | None = None) -> None:
    """``measured_on``: the machine that made the numbers, where another than this one (tables made from runs'
    results.json files brought back from a leased GPU)."""
    path = Path(path)
    if path.resolve() == Path(__file__).resolve().parents[1] / "BENCHMARKS.md":
        raise ValueError("BENCHMARKS.md is generated from benchmarks/results/ by benchmarks/results_page.py: write the run's "
                         "result file there (benchmarks/heads_side_by_side.py) and regenerate it, or name a notes file")
    header = "" if path.exists() else "# Benchmarks\n\nEvery section is written by the script named in it; newest last.\n"
    stamp = datetime.date.today().isoformat()
    section = f"\n## {title}\n\n- date: {stamp}\n- machine: {measured_on or machine()}\n- command: `{command()}`\n\n{body.rstrip()}\n"
    with path.open("a") as f:
        f.write(header + section)
