"""Rewriting an exported EAGLE-3 head in its other layout (flat <-> speculators), tensors untouched."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from headstart.heads.eagle3.config import Eagle3Config
from headstart.heads.eagle3.speculators import from_speculators_tensors, is_speculators, to_speculators_tensors
from headstart.models.export import replace_dir
from headstart.models.files import check_out_dir, claim_dir
from headstart.models.provenance import read_provenance, write_provenance


def convert_eagle3(source: str | Path, out: str | Path, to: str, verifier: dict | None = None,
                   force: bool = False, config_class: type[Eagle3Config] = Eagle3Config) -> Path:
    """Rewrite an exported EAGLE-3 head in the other layout without touching a tensor's values or dtype.

    ``verifier`` (a fingerprint) names the target in a speculators config; default: the one the head
    records (``headstart.json``) or, converting from speculators, the one its config names. ``out``
    must not hold anything unless ``force`` (then what it held is moved aside to ``<out>.old-<time>``), nor be, hold or
    lie inside ``source``; it appears whole or not at all. ``config_class``: the config of a head
    built on EAGLE-3's (P-EAGLE's), which reads and writes its own keys."""
    source, out = Path(source), Path(out)
    if to not in ("flat", "speculators"):
        raise ValueError(f"--to must be flat or speculators, got {to!r}")
    for name in ("config.json", "model.safetensors"):
        if not (source / name).is_file():
            raise FileNotFoundError(f"{source}: no {name}; expected an exported EAGLE-3 head")
    check_out_dir(out, "--out", force, [source])  # never the head's own directory, inside it or above it
    raw = json.loads((source / "config.json").read_text())
    config = config_class.from_json(source / "config.json")
    record = read_provenance(source) or {"head": config.speculators_type}
    target = record.get("target") or verifier
    if verifier is None:
        verifier = record.get("target") or ((raw.get("speculators_config") or {}).get("verifier") if is_speculators(raw) else None)
    tensors = load_file(str(source / "model.safetensors"))
    if is_speculators(raw):
        tensors = from_speculators_tensors(tensors)
    if to == "speculators":
        tensors, new_config = to_speculators_tensors(tensors), config.to_speculators_dict(verifier)
    else:
        new_config = config.to_hf_dict()
    floats = {v.dtype for v in tensors.values() if v.is_floating_point()}
    new_config["torch_dtype"] = str(floats.pop()).removeprefix("torch.") if len(floats) == 1 else new_config["torch_dtype"]
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    claim_dir(out, "--out", force, [source])  # with force, what --out held is moved aside, not deleted
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(new_config, indent=2))
    write_provenance(tmp, record.get("head", config.speculators_type), to, target)
    replace_dir(tmp, out)
    return out
