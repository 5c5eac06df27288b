"""What every file benchmarks/ writes records of the run that made it (command, commit, machine, date), and the one
rule for a result file meant for BENCHMARKS.md: it comes from a clean checkout.

- ``write_result(path, record)``: a result file (JSON; in benchmarks/results/ for the page). Into benchmarks/results/,
  a checkout whose tracked files differ from its commit is refused (the numbers could not be reproduced from the
  commit); with ``allow_dirty``, or elsewhere, the file is written and marked ``"dirty": true``, which the page prints
  next to its commit.
- ``write_table(path, title, body)``: a driver's markdown table, written whole (never appended to), headed by the same
  provenance; a dirty checkout is said in its header.
"""

from __future__ import annotations

import json
from pathlib import Path

from headstart.decode.report import provenance

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def is_dirty(commit: str | None) -> bool:
    return bool(commit) and commit.endswith("-dirty")


def refuse_dirty(commit: str | None, what: str) -> None:
    """Refuse to make ``what`` (a result file for BENCHMARKS.md) from a checkout with uncommitted changes."""
    if is_dirty(commit):
        raise SystemExit(f"{what}: the checkout has uncommitted changes to tracked files (commit {commit}); a result "
                            "file for BENCHMARKS.md must come from a commit: commit or stash them, or pass --allow-dirty "
                            "to write it marked dirty")


def write_result(path: str | Path, record: dict, allow_dirty: bool = False) -> dict:
    """``record`` with the run's provenance, written to ``path`` as JSON. Into benchmarks/results/ (for the page) a
    dirty checkout is refused unless ``allow_dirty``; anywhere the file is then marked ``"dirty": true``."""
    made = provenance()
    if not allow_dirty and Path(path).resolve().parent == RESULTS:
        refuse_dirty(made["commit"], str(path))
    out = {**record, **made, **({"dirty": True} if is_dirty(made["commit"]) else {})}
    Path(path).write_text(json.dumps(out, indent=1) + "\n")
    return out


def write_table(path: str | Path, title: str, body: str, measured_on: str | None = None) -> None:
    """A markdown file: ``# title``, the provenance (``measured_on``: the machine that made the numbers where another
    than this one, e.g. runs' results.json files made elsewhere), then ``body``. Written whole."""
    made = provenance()
    commit = made["commit"] or "none (not a git checkout)"
    if is_dirty(made["commit"]):
        commit += " -- UNCOMMITTED CHANGES: not reproducible from the commit"
    header = (f"# {title}\n\n- command: `{made['command']}`\n- commit: {commit}\n"
              f"- machine: {measured_on or made['machine']}\n- date: {made['date']}\n")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(f"{header}\n{body.rstrip()}\n")
