"""Writing a finished head: atomically, in the layouts asked for, with the record of its target.

``format`` names one of the head's ``layouts`` or ``both`` (all of them). The first layout goes to
``directory``; each further one to ``directory/<layout>`` (servers read only the top level of a
model directory, so the nested copy does not disturb the first): ``export.format: both`` on an
EAGLE-3 run gives ``final/`` (flat: SGLang, vLLM with ``method: eagle3``) and ``final/speculators/``
(``vllm serve final/speculators``).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch

from headstart.models.files import share_like_umask
from headstart.models.head import check_layout
from headstart.models.provenance import write_provenance


def layouts_for(head, format: str | None) -> tuple[str, ...]:
    """The layouts ``format`` asks of ``head`` (None or "default": its first), refused by name."""
    if format == "both":
        return tuple(head.layouts)
    try:
        return (check_layout(head, None if format in (None, "", "default") else format),)
    except ValueError as err:
        raise ValueError(f"export.format {format!r}: {err} (or 'both')") from None


HOLD_ENV = "HEADSTART_EXPORT_HOLD_S"
"""Seconds a finished export waits before it is put in place. Set only by the kill soak (benchmarks/soak_kill.py):
a tiny head is written in about a millisecond, shorter than the soak's watcher needs to see the write and kill
inside it, as a kill on a real head's slower write would."""


def replace_dir(tmp: Path, directory: Path) -> None:
    """Put the finished ``tmp`` at ``directory``; the previous one is moved aside, never deleted
    before the new one is in place (a crash in between leaves it at ``.old-<name>``, restored on the
    next export)."""
    share_like_umask(tmp)  # safetensors writes 0600: a server running as another user could not read the head
    hold = float(os.environ.get(HOLD_ENV) or 0)
    if hold > 0:
        time.sleep(hold)
    old = directory.with_name(f".old-{directory.name}")
    if directory.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(directory, old)
    os.replace(tmp, directory)
    shutil.rmtree(old, ignore_errors=True)


def export_head(head, directory: str | Path, name: str, target: dict | None, format: str | None = None,
                state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``head`` (``state_dict``: its gathered state when sharded) to ``directory``, replacing
    what was there only once the new export is whole. ``target``: the target's fingerprint."""
    directory = Path(directory)
    tmp, old = directory.with_name(f".tmp-{directory.name}"), directory.with_name(f".old-{directory.name}")
    if old.exists() and not directory.exists():  # a crash between the two renames of replace_dir
        os.replace(old, directory)
    shutil.rmtree(tmp, ignore_errors=True)
    tensors = head.export_state_dict(state_dict)
    for i, layout in enumerate(layouts_for(head, format)):
        where = tmp if i == 0 else tmp / layout
        head.save_pretrained(where, state_dict=tensors, layout=layout, verifier=target)
        write_provenance(where, name, layout, target)
    replace_dir(tmp, directory)
    return directory
