"""Never write over a finished run by accident.

A training run, a feature job and a regeneration job each own an output directory. Starting one in
a directory that already holds such work is refused unless the user says which of the two they mean:
``--resume`` (continue it) or ``--overwrite`` (move it aside to ``<dir>.old-<time>``, never delete it,
and start again).

On several ranks (several nodes) the directory must also be one directory: rank 0 writes checkpoints and exports, and
every rank reads a checkpoint back on ``--resume`` (DeepSpeed: writes its own partition into it); a path that is
local to each node would train for hours and then fail at the first resume, so it is refused at the start.
"""

from __future__ import annotations

import socket
import time
import uuid
from pathlib import Path

import torch.distributed as dist

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
        check_one_directory(out, what, info)
    return aside


def check_one_directory(out: Path, what: str, info: DistInfo, wait_s: float = 5.0) -> None:
    """Collective: refuse, on every rank, an ``out`` that is not the same directory for every rank (node-local
    storage on a multi-node job). Rank 0 writes a probe file with a fresh name; every rank looks for it (for up to
    ``wait_s``: a network file system may show another node's new file a moment late)."""
    name = [f".probe-{uuid.uuid4().hex}" if info.is_main else None]
    dist.broadcast_object_list(name, src=0)
    probe = out / name[0]
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_text("written by rank 0 to check that every rank sees this directory\n")
    barrier()
    deadline = time.monotonic() + wait_s
    while not probe.is_file() and time.monotonic() < deadline:
        time.sleep(0.2)
    seen: list[tuple[bool, str, int] | None] = [None] * info.world_size
    dist.all_gather_object(seen, (probe.is_file(), socket.gethostname(), info.rank))
    if info.is_main:
        probe.unlink(missing_ok=True)
    blind = [(host, rank) for ok, host, rank in seen if not ok]
    if blind:
        hosts = ", ".join(sorted({host for host, _ in blind}))
        ranks = ", ".join(str(rank) for _, rank in blind)
        raise ValueError(f"{out} is not one directory for every rank: rank(s) {ranks} on {hosts} do not see the file "
                         f"rank 0 wrote there. The {what}'s checkpoints and outputs are written by rank 0 and read by "
                         "every rank: put the output directory on storage every node mounts (NFS, Lustre, a shared "
                         "volume) at the same path")
