"""Dispatch over the head catalog for exported heads: which head and layout a directory holds (``detect_layout``),
converting it to another layout (``convert_head``), and ``check_head``: everything a server would get silently wrong about an exported head, found before deploying it.

``check_head(directory, target_path)`` finds which registered head and layout the directory holds (each
head's ``detect``), checks the record of the target it was trained for, and runs that head's rules (its
registry entry's ``check``: EAGLE-3 reads its config and tensors' names, shapes and dtypes key by key,
``heads/eagle3/check.py``); a head without its own rules is checked by its reader (``load``), which refuses by
name what does not fit the target. It returns one ``Problem`` per thing wrong, each naming the file and key.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from transformers import AutoConfig

from headstart.heads.registry import HEADS, load_head
from headstart.models.problem import Problem
from headstart.models.provenance import PROVENANCE_FILE, check_record, read_provenance, target_mismatch
from headstart.models.target import TargetConfig
from headstart.models.target_matrices import TargetMatrices


def detect_layout(directory: Path) -> tuple[str, str] | None:
    """(head name, layout) of an exported head, asking each registered head's ``detect`` in turn."""
    config_path = Path(directory) / "config.json"
    if not config_path.is_file():
        return None
    d = json.loads(config_path.read_text())
    for name, spec in HEADS.items():
        layout = spec.detect(Path(directory), d)
        if layout is not None:
            return name, layout
    return None


def check_head(directory: str | Path, target_path: str | Path,
               allow_other_target: bool = False) -> tuple[str, list[Problem], list[str]]:
    """(what the directory holds, the problems found, notes) for an exported head used with ``target_path``."""
    directory = Path(directory)
    try:
        found = detect_layout(directory)
    except Exception as err:  # an unreadable config.json or safetensors index: report it, do not crash
        return "unreadable", [Problem(str(directory / "config.json"), "-", f"cannot be read: {err}")], []
    if found is None:
        known = "; ".join(f"{name}: {', '.join(spec.cards)}" for name, spec in HEADS.items())
        return "unknown", [Problem(str(directory / "config.json"), "-", "not a head headstart can read: expected an "
                                   f"export of a registered head ({known})")], []
    head, layout = found
    problems: list[Problem] = []
    notes: list[str] = []
    record_file = str(directory / PROVENANCE_FILE)
    try:
        why = target_mismatch(directory, target_path)
        if read_provenance(directory) is None or not (read_provenance(directory) or {}).get("target"):
            notes.append(f"{record_file} is missing or records no target: the target was not verified")
    except Exception as err:
        why = None
        problems.append(Problem(record_file, "-", f"cannot be read: {err}"))
    if why and allow_other_target:
        notes.append(f"warning: {why}")
    elif why:
        problems.append(Problem(record_file, "target", why))
    spec = HEADS[head]
    if spec.check is not None:
        try:
            check_record(directory, head)
            problems += spec.check(directory, layout, AutoConfig.from_pretrained(str(target_path)))
        except Exception as err:  # a truncated or corrupt file: one problem naming it, not a traceback
            problems.append(Problem(str(directory), head, f"cannot be read: {err}"))
    else:
        problems += check_by_loading(head, directory, target_path)
    return f"{head} ({layout} layout)", problems, notes


def check_by_loading(head: str, directory: Path, target_path: str | Path) -> list[Problem]:
    """A head without rules of its own: its reader refuses by name what does not fit (names, shapes, its config
    against the target)."""
    try:
        matrices = TargetMatrices(TargetConfig(path=str(target_path), dtype="float32"))
        with warnings.catch_warnings():  # the target's identity was checked by check_head, once
            warnings.simplefilter("ignore")
            load_head(head, str(directory), matrices, allow_other_target=True)
    except Exception as err:
        return [Problem(str(directory), head, str(err))]
    return []


def convert_head(source: str | Path, out: str | Path, to: str, verifier: dict | None = None,
                 force: bool = False) -> Path:
    """Rewrite an exported head in another of its layouts (its registry entry's ``convert``), tensors unchanged.
    ``verifier``: the target's fingerprint, for layouts whose config names it."""
    for name in ("config.json", "model.safetensors"):
        if not (Path(source) / name).is_file():
            raise FileNotFoundError(f"{source}: no {name}; expected an exported head")
    found = detect_layout(Path(source))
    if found is None:
        raise ValueError(f"{source}: not an export of a registered head ({sorted(HEADS)})")
    spec = HEADS[found[0]]
    if to not in spec.cards:
        raise ValueError(f"{source} holds {found[0]} ({found[1]} layout); {found[0]} heads are exported in "
                         f"{list(spec.cards)}, not {to!r}")
    if spec.convert is None:
        raise ValueError(f"{found[0]} heads have no layout converter")
    return spec.convert(source, out, to, verifier, force)

