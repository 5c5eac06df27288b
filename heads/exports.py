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
from headstart.models.errors import UserError
from headstart.models.files import check_out_dir
from headstart.models.problem import Problem
from headstart.models.provenance import PROVENANCE_FILE, check_record, read_provenance, target_mismatch
from headstart.models.target import TargetConfig
from headstart.models.target_matrices import TargetMatrices
from headstart.models.weights_file import check_safetensors


def detect_layout(directory: Path) -> tuple[str, str] | None:
    """(head name, layout) of an exported head: the one registered head whose ``detect`` claims it (the catalog's order
    does not matter: two claims are a detector's bug, refused by name; tests/test_catalog.py holds every detector to
    its own exports)."""
    config_path = Path(directory) / "config.json"
    if not config_path.is_file():
        return None
    d = json.loads(config_path.read_text())
    claims = [(name, layout) for name, spec in HEADS.items() if (layout := spec.detect(Path(directory), d)) is not None]
    if len(claims) > 1:
        raise ValueError(f"{directory}: the detectors of {[name for name, _ in claims]} all claim this export; a "
                         "detector must claim only its own head's exports")
    return claims[0] if claims else None


def read_config(directory: str | Path, flag: str) -> dict:
    """A head's or model's ``config.json``, refused by name (with ``flag``, the option that gave the directory) when
    the directory or the file is missing or the file is not a JSON object."""
    directory = Path(directory)
    if not directory.is_dir():
        raise UserError(f"{flag} {directory}: " + ("a file, not a directory" if directory.exists() else "no such directory")
                        + "; give the directory a head was exported to (it holds config.json and model.safetensors)")
    path = directory / "config.json"
    if not path.is_file():
        raise UserError(f"{flag} {directory}: no config.json, so not an exported head or model; give the directory the "
                        "export wrote (a run's final/ or best/), or export the head again")
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise UserError(f"{flag} {path}: not valid JSON ({err}); export the head again or repair the file") from None
    if not isinstance(config, dict):
        raise UserError(f"{flag} {path}: expected a JSON object, found {type(config).__name__}; export the head again")
    return config


def check_readable(directory: str | Path, flag: str, weights: bool = True) -> dict:
    """Before anything loads: ``directory``'s config.json (returned) and each of its ``.safetensors`` files whole, from
    their headers; ``weights``: refuse a directory without any."""
    config = read_config(directory, flag)
    files = sorted(Path(directory).glob("*.safetensors"))
    if weights and not files:
        raise UserError(f"{flag} {directory}: no model.safetensors (the weights); export the head again")
    for file in files:
        check_safetensors(file)
    return config


def check_draft(directory: str | Path, method: str, decodes: str | None, flag: str = "--draft") -> tuple[str, str] | None:
    """Before any model loads: ``directory`` readable (``check_readable``) and holding what ``--method method``
    decodes (``decodes``: the catalog head whose exports it reads, None for a method that is not a head's): (head,
    layout) of a head's export, or None for a plain causal LM given to a method that decodes one. A head of another
    kind is refused with the ``--method`` that decodes it."""
    check_readable(directory, flag)
    found = detect_layout(Path(directory))
    if found is None:
        if decodes is not None:
            raise UserError(f"{flag} {directory}: not an export of a {HEADS[decodes].title} (its config.json is none of "
                            f"{', '.join(HEADS[decodes].cards)}); give the directory a {decodes} run exported")
        return None
    head, layout = found
    runs_as = HEADS[head].decoded_by or head
    if runs_as != (decodes or method) and (decodes is not None or HEADS[head].decoded_by is None):
        raise UserError(f"{flag} {directory} holds {head} ({HEADS[head].title}, {layout} layout), which --method "
                        f"{method} does not decode; run it with --method {runs_as}")
    return found


def trained_depth(directory: str | Path) -> int | None:
    """The drafts per round the head in ``directory`` was made for, as its export records it (its heads, unrolled steps,
    block, or the k it tells a server); None when it records none (or is not a head's export)."""
    found = detect_layout(Path(directory))
    depth = HEADS[found[0]].trained_depth if found else None
    return depth(read_config(directory, "--draft")) if depth else None


def check_head(directory: str | Path, target_path: str | Path,
               allow_other_target: bool = False) -> tuple[str, list[Problem], list[str]]:
    """(what the directory holds, the problems found, notes) for an exported head used with ``target_path``."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        where = "no config.json" if directory.is_dir() else "no such directory"
        return "unreadable", [Problem(str(directory), "-", f"{where}: give the directory the head was exported to "
                                      "(it holds config.json and model.safetensors)")], []
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
    check_readable(source, "--head")
    check_out_dir(out, "--out", force, [source])  # before anything is written: never over the head being read
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

