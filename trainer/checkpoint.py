"""Atomic checkpoints: a kill mid-write leaves the previous checkpoint whole.

    <output_dir>/checkpoints/step_000200/{state/, draft/, trainer_state.json}
    <output_dir>/checkpoints/latest          -> "step_000200"

Everything is written into a hidden temp directory first; rank 0 renames it into place and only
then rewrites ``latest`` (itself through a temp file and ``os.replace``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

from headstart.models.files import share_like_umask
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
    previous = latest_checkpoint(output_dir) if info.is_main else None
    with written(f"checkpoint {name}", previous, cleanup=tmp if info.is_main else None):
        if info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "state").mkdir(parents=True)
        barrier()
        save_state(tmp / "state")
        export_draft(tmp / "draft")
        barrier()
        if info.is_main:
            (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
            share_like_umask(tmp)  # safetensors writes 0600: give the run's files the umask's mode
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


class WriteError(OSError):
    """A run's output could not be written (disk full, read-only, quota); says what is still whole."""


@contextlib.contextmanager
def written(what: str, previous: Path | None, cleanup: Path | None = None) -> Iterator[None]:
    """Turn an OSError while writing ``what`` into one message naming the path, the cause and what the
    user still has; the half-written ``cleanup`` directory is removed (best effort: the disk may be full)."""
    try:
        yield
    except WriteError:
        raise
    except Exception as err:
        if not _is_write_failure(err):
            raise
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)
        where = getattr(err, "filename", None) or cleanup or "its directory"
        cause = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        kept = (f"the last checkpoint, {previous}, is whole: free space (or fix permissions) and continue with --resume"
                if previous is not None else "no checkpoint was written yet")
        raise WriteError(getattr(err, "errno", None), f"could not write {what} to {where}: {cause}; {kept}") from err


def _is_write_failure(err: Exception) -> bool:
    """OSError from Python's own writes; safetensors reports the OS error in its own type; torch.save (DeepSpeed's
    checkpoint) in a RuntimeError from its zip writer."""
    return (isinstance(err, OSError) or type(err).__name__ == "SafetensorError"
            or (isinstance(err, RuntimeError) and "inline_container" in str(err)))


def _prune(root: Path, keep: int, current: str) -> None:
    done = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in done[: max(0, len(done) - keep)]:
        if old.name != current:
            shutil.rmtree(old, ignore_errors=True)
