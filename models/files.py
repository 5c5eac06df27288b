"""What every command that writes does alike: give written files the umask's mode, and claim an output directory
without losing what it held.

Permissions: safetensors' writer and temp files create files 0600 whatever the umask, so a server running as another
user (or in a container) could not read the head it was given. Every writer calls ``share_like_umask`` on what it
wrote, which sets the mode an ordinary ``open`` would have given (0666 & ~umask; directories 0777 & ~umask).

Output directories: ``check_out_dir`` refuses, before any work, a directory that holds anything unless ``--overwrite``,
and always one that is (or holds, or sits inside) the command's own input; ``claim_dir`` then moves what it held
aside to ``<dir>.old-<time>`` (never deleting it) when the user passed ``--overwrite``.
"""

from __future__ import annotations

import functools
import os
import re
import time
from collections.abc import Iterable
from pathlib import Path

from headstart.models.errors import UserError


@functools.lru_cache(maxsize=1)
def umask() -> int:
    """The process's umask, read without changing it where the kernel reports it (Linux >= 4.7: another thread
    creating a file meanwhile would otherwise get the temporary mask)."""
    try:
        match = re.search(r"^Umask:\s*([0-7]+)", Path("/proc/self/status").read_text(), re.MULTILINE)
        if match:
            return int(match.group(1), 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere: read by setting it, then put it back at once
    os.umask(mask)
    return mask


def share_like_umask(path: str | Path) -> None:
    """Give ``path`` (a file, or a directory and everything under it) the mode an ordinary ``open``/``mkdir`` would
    have: 0666 & ~umask for files, 0777 & ~umask for directories. Symbolic links are left alone: the file they point
    to is someone else's (a target's shard linked into a checkpoint)."""
    path = Path(path)
    file_mode, dir_mode = 0o666 & ~umask(), 0o777 & ~umask()
    if path.is_symlink():
        return
    if not path.is_dir():
        os.chmod(path, file_mode)
        return
    os.chmod(path, dir_mode)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            entry = os.path.join(root, name)
            if not os.path.islink(entry):
                os.chmod(entry, dir_mode if name in dirs else file_mode)


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def check_out_dir(out: str | Path, flag: str, overwrite: bool, sources: Iterable[str | Path] = ()) -> None:
    """Refuse ``out`` (the command's ``flag``) when it is a file, when it is one of ``sources`` (what the command
    reads), lies inside one or holds one (``--overwrite`` would move the input away), or when it holds anything and
    ``overwrite`` is not set."""
    out = Path(out)
    resolved = out.resolve()
    for source in sources:
        src = Path(source).resolve()
        if _within(src, resolved):
            what = "is" if src == resolved else "holds"
            raise UserError(f"{flag} {out} {what} this command's own input {source}: write to a directory outside it "
                            "(nothing was changed)")
        if src.is_dir() and _within(resolved, src):
            raise UserError(f"{flag} {out} is inside this command's own input {source}: write to a directory outside "
                            "it (nothing was changed)")
    if out.exists() and not out.is_dir():
        raise UserError(f"{flag} {out} is a file, not a directory: give a new or empty directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"{flag} {out} already holds files: give a new or empty directory, or pass --overwrite to move "
                        f"what it holds aside to {out.name}.old-<time> (nothing is deleted)")


def move_aside(directory: str | Path) -> Path:
    """Rename ``directory`` to ``<directory>.old-<time>`` (a free name) and return where it went."""
    directory = Path(directory)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = directory.with_name(f"{directory.name}.old-{stamp}"), 1
    while aside.exists():
        aside, n = directory.with_name(f"{directory.name}.old-{stamp}-{n}"), n + 1
    os.rename(directory, aside)
    return aside


def claim_dir(out: str | Path, flag: str, overwrite: bool, sources: Iterable[str | Path] = ()) -> Path | None:
    """``check_out_dir``, then, with ``overwrite``, move what ``out`` holds aside; returns where it went, if anywhere.
    Call it where the command starts writing, after ``check_out_dir`` refused early what it would refuse."""
    sources = tuple(sources)
    check_out_dir(out, flag, overwrite, sources)
    out = Path(out)
    if not (out.is_dir() and any(out.iterdir())):
        return None
    aside = move_aside(out)
    print(f"moved what {out} held aside to {aside}")
    return aside
