"""Atomic checkpoints: a kill mid-write leaves the previous checkpoint whole.

    <output_dir>/checkpoints/step_000200/{state/, draft/, trainer_state.json}
    <output_dir>/checkpoints/latest          -> "step_000200"

Everything is written into a hidden temp directory first; rank 0 renames it into place and only
then rewrites ``latest`` (itself through a temp file and ``os.replace``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from headstart.trainer.distributed import DistInfo, barrier


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    root = checkpoint_root(output_dir)
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    if not (path / "trainer_state.json").is_file():
        raise FileNotFoundError(f"{pointer} names {path.name}, which is missing or incomplete")
    return path


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    info: DistInfo,
    save_state: Callable[[Path], None],
    export_draft: Callable[[Path], None],
    trainer_state: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Collective: every rank calls it. ``save_state`` runs on all ranks, ``export_draft`` on all
    (it gathers), and writes only on rank 0."""
    root = checkpoint_root(output_dir)
    name = f"step_{step:06d}"
    tmp = root / f".tmp-{name}"
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "state").mkdir(parents=True)
    barrier()
    save_state(tmp / "state")
    export_draft(tmp / "draft")
    barrier()
    if info.is_main:
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
        final = root / name
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer_tmp = root / ".latest.tmp"
        pointer_tmp.write_text(name)
        os.replace(pointer_tmp, root / "latest")
        _prune(root, keep, name)
    barrier()
    return root / name


def _prune(root: Path, keep: int, current: str) -> None:
    done = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in done[: max(0, len(done) - keep)]:
        if old.name != current:
            shutil.rmtree(old, ignore_errors=True)
