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

from headstart.models.provenance import read_provenance, write_provenance


def layouts_for(head, format: str | None) -> tuple[str, ...]:
    """The layouts ``format`` asks of ``head`` (None or "default": its first), refused by name."""
    if format in (None, "", "default"):
        return head.layouts[:1]
    if format == "both":
        return tuple(head.layouts)
    if format not in head.layouts:
        raise ValueError(f"export.format {format!r}: {type(head).__name__} is exported as one of {list(head.layouts)} "
                         "(or 'both')")
    return (format,)


def export_head(head, directory: str | Path, name: str, target: dict | None, format: str | None = None,
                state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``head`` (``state_dict``: its gathered state when sharded) to ``directory``, replacing
    what was there only once the new export is whole. ``target``: the target's fingerprint."""
    directory = Path(directory)
    tmp = directory.with_name(f".tmp-{directory.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tensors = head.export_state_dict(state_dict)
    for i, layout in enumerate(layouts_for(head, format)):
        where = tmp if i == 0 else tmp / layout
        head.save_pretrained(where, state_dict=tensors, layout=layout, verifier=target)
        write_provenance(where, name, layout, target)
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(tmp, directory)
    return directory


def convert_eagle3(source: str | Path, out: str | Path, to: str, verifier: dict | None = None) -> Path:
    """Rewrite an exported EAGLE-3 head in the other layout without touching a tensor's values or dtype.

    ``verifier`` (a fingerprint) names the target in a speculators config; default: the one the head
    records (``headstart.json``) or, converting from speculators, the one its config names."""
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
    raw = json.loads((source / "config.json").read_text())
    config = Eagle3Config.from_json(source / "config.json")
    record = read_provenance(source) or {"head": "eagle3"}
    if verifier is None:
        verifier = record.get("target") or ((raw.get("speculators_config") or {}).get("verifier") if is_speculators(raw) else None)
    tensors = from_speculators_tensors(load_file(str(source / "model.safetensors")))
    if to == "speculators":
        if not (verifier or {}).get("name_or_path"):
            raise ValueError(f"{source} records no target, and vLLM refuses a speculators config without one "
                             "(speculators_config.verifier.name_or_path): pass --target")
        tensors, new_config = to_speculators_tensors(tensors), to_speculators_config(config, verifier)
    else:
        new_config = config.to_hf_dict()
    if out.resolve() == source.resolve():
        raise ValueError(f"--out {out} is the head's own directory; write the converted head elsewhere")
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(new_config, indent=2))
    write_provenance(out, record.get("head", "eagle3"), to, record.get("target"))
    return out
