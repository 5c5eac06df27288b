"""Which target a head was trained against, recorded beside every export and checked on every load.

A head trained for one target runs silently against another of the same shapes (the Llama demo
target and a Qwen3 target of equal size, say) and accepts nothing. So every exported head
directory carries ``headstart.json``:

    {"head": "eagle3", "layout": "flat", "headstart_version": "0.1.0",
     "target": {"name_or_path": ..., "architectures": [...], "config_sha256": ..., "tokenizer_sha256": ...}}

and the decoder, the benchmark and ``scripts/check_head.py`` compare the two hashes with the target
they are given. The hashes are the feature store's (trainer/feature_store.py uses ``fingerprint``
too): the target's config.json without the keys that change when the same weights are re-saved,
and its tokenizer files.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

PROVENANCE_FILE = "headstart.json"
# Keys that differ between two saves of the same model (path, library version, dtype spelling).
_VOLATILE_KEYS = ("_name_or_path", "transformers_version", "torch_dtype", "dtype")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "tokenizer_config.json")


class OtherTargetError(ValueError):
    """A head used with a target other than the one it was trained against."""


def sha256_files(*paths: Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        if p.is_file():
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def fingerprint(target_path: str | Path) -> dict:
    """The identity of the HF checkpoint at ``target_path``: its config and tokenizer hashes."""
    root = Path(target_path)
    config_file = root / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no HF checkpoint at {str(target_path)!r}: config.json not found")
    config = json.loads(config_file.read_text())
    architectures = config.get("architectures") or []
    for key in _VOLATILE_KEYS:
        config.pop(key, None)
    return {
        "name_or_path": str(target_path),
        "architectures": architectures,
        "config_sha256": hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16],
        "tokenizer_sha256": sha256_files(*(root / n for n in _TOKENIZER_FILES)),
    }


def _headstart_version() -> str:
    try:
        return version("headstart")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


def write_provenance(directory: str | Path, head: str, layout: str, target: dict | None) -> None:
    """Write ``headstart.json`` into an exported head directory; ``target`` is a ``fingerprint``."""
    record = {"head": head, "layout": layout, "headstart_version": _headstart_version(), "target": target}
    (Path(directory) / PROVENANCE_FILE).write_text(json.dumps(record, indent=2) + "\n")


def read_provenance(directory: str | Path) -> dict | None:
    path = Path(directory) / PROVENANCE_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return record


def target_mismatch(directory: str | Path, target_path: str | Path) -> str | None:
    """Why the head in ``directory`` was not trained for the target at ``target_path``; None if it
    was, or if the head records no target (an export from before provenance, or a hand-made one)."""
    record = read_provenance(directory)
    recorded = (record or {}).get("target")
    if not recorded:
        return None
    given = fingerprint(target_path)
    differs = [what for key, what in (("config_sha256", "config.json"), ("tokenizer_sha256", "tokenizer"))
               if recorded.get(key) != given[key]]
    if not differs:
        return None
    return (f"{directory} was trained against {recorded.get('name_or_path')} "
            f"({', '.join(recorded.get('architectures') or ['?'])}), but the target given is {target_path} "
            f"({', '.join(given['architectures']) or '?'}): its {' and '.join(differs)} differ "
            f"({Path(directory) / PROVENANCE_FILE})")


def check_target(directory: str | Path, target_path: str | Path | None, allow_other_target: bool = False) -> None:
    """Refuse a head used with another target, naming both; ``allow_other_target`` only warns."""
    if target_path is None:
        return
    why = target_mismatch(directory, target_path)
    if why is None:
        return
    if allow_other_target:
        warnings.warn(f"{why}; going on because other targets are allowed", stacklevel=2)
        return
    raise OtherTargetError(f"{why}. A head accepts almost nothing on a target it was not trained for; "
                           "pass --allow-other-target if this is really what you want")
