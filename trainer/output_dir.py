"""Never write over a finished run by accident.

A training run, a feature job and a regeneration job each own an output directory. Starting one in
a directory that already holds such work is refused unless the user says which of the two they mean:
``--resume`` (continue it) or ``--overwrite`` (move it aside to ``<dir>.old-<time>``, never delete it,
and start again).
"""

from __future__ import annotations

from pathlib import Path

from headstart.models.files import move_aside
from headstart.trainer.distributed import DistInfo, barrier

TRAINING_RUN = ("checkpoints", "metrics.jsonl", "final")
"""What a training run leaves in its output_dir."""
JOB_PLAN = ("plan.json",)
"""What a feature or regeneration job writes first (its settings, checked on resume)."""


def claim_output_dir(out: str | Path, markers: tuple[str, ...], what: str, resume: bool, overwrite: bool,
                     info: DistInfo | None = None) -> Path | None:
    """Collective when ``info`` has several ranks. Returns where an overwritten run was moved, if any."""
    if resume and overwrite:
        raise ValueError("--resume continues the run in the output directory and --overwrite moves it aside: pass one")
    out = Path(out)
    found = [m for m in markers if (out / m).exists()]
    if found and not (resume or overwrite):  # every rank sees the same files and raises alike
        raise ValueError(f"{out} already holds a {what} ({', '.join(found)}). Pass --resume to continue it, or "
                         f"--overwrite to move it aside to {out.name}.old-<time> and start again")
    aside = None
    if found and overwrite and (info is None or info.is_main):
        aside = move_aside(out)
        print(f"moved the {what} in {out} aside to {aside}")
    if info is not None and info.world_size > 1:
        barrier()  # no rank writes into the directory before it has been moved
    return aside
