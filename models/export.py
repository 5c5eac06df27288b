"""Writing a finished head: atomically, in the layouts asked for, with the record of its target.

``format`` names one of the head's ``layouts`` or ``both`` (all of them). The first layout goes to
``directory``; each further one to ``directory/<layout>`` (servers read only the top level of a
model directory, so the nested copy does not disturb the first): ``export.format: both`` on an
EAGLE-3 run gives ``final/`` (flat: SGLang, vLLM with ``method: eagle3``) and ``final/speculators/``
(``vllm serve final/speculators``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from headstart.models.head import check_layout
from headstart.models.provenance import read_provenance, write_provenance


def layouts_for(head, format: str | None) -> tuple[str, ...]:
    """The layouts ``format`` asks of ``head`` (None or "default": its first), refused by name."""
    if format == "both":
        return tuple(head.layouts)
    try:
        return (check_layout(head, None if format in (None, "", "default") else format),)
    except ValueError as err:
        raise ValueError(f"export.format {format!r}: {err} (or 'both')") from None


def replace_dir(tmp: Path, directory: Path) -> None:
    """Put the finished ``tmp`` at ``directory``; the previous one is moved aside, never deleted
    before the new one is in place (a crash in between leaves it at ``.old-<name>``, restored on the
    next export)."""
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


def convert_eagle3(source: str | Path, out: str | Path, to: str, verifier: dict | None = None,
                   force: bool = False) -> Path:
    """Rewrite an exported EAGLE-3 head in the other layout without touching a tensor's values or dtype.

    ``verifier`` (a fingerprint) names the target in a speculators config; default: the one the head
    records (``headstart.json``) or, converting from speculators, the one its config names. ``out``
    must not hold anything unless ``force``; it appears whole or not at all."""
    from headstart.models.eagle3 import Eagle3Config
    from headstart.models.speculators_layout import (
        from_speculators_tensors,
        is_speculators,
        to_speculators_config,
        to_speculators_tensors,
    )

    source, out = Path(source), Path(out)
    if to not in ("flat", "speculators"):
        raise ValueError(f"--to must be flat or speculators, got {to!r}")
    for name in ("config.json", "model.safetensors"):
        if not (source / name).is_file():
            raise FileNotFoundError(f"{source}: no {name}; expected an exported EAGLE-3 head")
    if out.resolve() == source.resolve() or source.resolve() in out.resolve().parents:
        raise ValueError(f"--out {out} is (inside) the head's own directory; write the converted head elsewhere")
    if out.exists() and any(out.iterdir()) and not force:
        raise ValueError(f"--out {out} already holds files; choose an empty directory (or --force to replace it)")
    raw = json.loads((source / "config.json").read_text())
    config = Eagle3Config.from_json(source / "config.json")
    record = read_provenance(source) or {"head": "eagle3"}
    target = record.get("target") or verifier
    if verifier is None:
        verifier = record.get("target") or ((raw.get("speculators_config") or {}).get("verifier") if is_speculators(raw) else None)
    tensors = load_file(str(source / "model.safetensors"))
    if is_speculators(raw):
        tensors = from_speculators_tensors(tensors)
    if to == "speculators":
        tensors, new_config = to_speculators_tensors(tensors), to_speculators_config(config, verifier)
    else:
        new_config = config.to_hf_dict()
    floats = {v.dtype for v in tensors.values() if v.is_floating_point()}
    new_config["torch_dtype"] = str(floats.pop()).removeprefix("torch.") if len(floats) == 1 else new_config["torch_dtype"]
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(new_config, indent=2))
    write_provenance(tmp, record.get("head", "eagle3"), to, target)
    replace_dir(tmp, out)
    return out
