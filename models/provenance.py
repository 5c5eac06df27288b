"""Which target a head was trained against, recorded beside every export and checked on every load.

A head trained for one target runs silently against another of the same shapes (the Llama demo
target and a Qwen3 target of equal size, say) and accepts nothing. So every exported head
directory carries ``headstart.json``:

    {"head": "eagle3", "layout": "flat", "headstart_version": "0.2.0",
     "target": {"name_or_path": ..., "architectures": [...], "config": {sizes, rope_theta},
                "config_sha256": ..., "tokenizer_sha256": ...}}

and the decoder, the benchmark and ``scripts/check_head.py`` compare it with the target they are
given: the sizes and rope of its architecture (not config.json's bytes, which change when the same
model is re-saved or quantized) and its tokenizer's vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

from headstart import __version__

PROVENANCE_FILE = "headstart.json"
# What identifies a target for a draft head: its architecture's sizes and rope, not the file's bytes -- a
# re-save by another transformers release, a quantized copy or an edited chat template is the same target.
_IDENTITY_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "intermediate_size", "vocab_size", "tie_word_embeddings")


ALLOW_OTHER_TARGET = "pass --allow-other-target if this is really what you want"
"""What to do about another target's head, where the command has the flag (bench, generate, check)."""


class OtherTargetError(ValueError):
    """A head used with a target other than the one it was trained against."""


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def target_config_identity(config: dict) -> dict:
    """The identity keys of an HF config.json (of its text config, for multimodal targets)."""
    text = config.get("text_config") or config
    identity = {k: text.get(k) for k in _IDENTITY_KEYS}
    rope = text.get("rope_parameters") or {}  # transformers >= 5; older configs keep rope_theta at the top
    identity["rope_theta"] = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
    return identity


def tokenizer_identity(root: Path) -> str | None:
    """A hash of the tokenizer's vocabulary (token -> id, added tokens included), or None without one."""
    if not any((root / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return _digest(sorted(AutoTokenizer.from_pretrained(str(root)).get_vocab().items()))


def fingerprint(target_path: str | Path) -> dict:
    """The identity of the HF checkpoint at ``target_path``: its architecture's sizes and its vocabulary."""
    root = Path(target_path)
    config_file = root / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no HF checkpoint at {str(target_path)!r}: config.json not found")
    config = json.loads(config_file.read_text())
    identity = target_config_identity(config)
    return {
        "name_or_path": str(target_path),
        "architectures": config.get("architectures") or [],
        "config": identity,
        "config_sha256": _digest(identity),
        "tokenizer_sha256": tokenizer_identity(root),
    }


def write_provenance(directory: str | Path, head: str, layout: str, target: dict | None) -> None:
    """Write ``headstart.json`` into an exported head directory; ``target`` is a ``fingerprint``."""
    record = {"head": head, "layout": layout, "headstart_version": __version__, "target": target}
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


def check_record(directory: str | Path, head: str) -> None:
    """Refuse a directory whose headstart.json says it holds another head type."""
    record = read_provenance(directory) or {}
    if record.get("head") not in (None, head):
        raise ValueError(f"{directory} holds a {record['head']} head ({Path(directory) / PROVENANCE_FILE}), not {head}")


def target_mismatch(directory: str | Path, target_path: str | Path) -> str | None:
    """Why the head in ``directory`` was not trained for the target at ``target_path``; None if it
    was, or if the head records no target (an export from before provenance, or a hand-made one)."""
    record = read_provenance(directory)
    recorded = (record or {}).get("target")
    if not recorded:
        return None
    given = fingerprint(target_path)
    differs = []
    if recorded.get("config_sha256") != given["config_sha256"]:
        keys = [k for k in given["config"] if (recorded.get("config") or {}).get(k) != given["config"][k]]
        differs.append("config (" + ", ".join(f"{k} {(recorded.get('config') or {}).get(k)} vs {given['config'][k]}"
                                              for k in keys) + ")")
    if None not in (recorded.get("tokenizer_sha256"), given["tokenizer_sha256"]) and \
            recorded["tokenizer_sha256"] != given["tokenizer_sha256"]:
        differs.append("tokenizer vocabulary")
    if not differs:
        return None
    return (f"{directory} was trained against {recorded.get('name_or_path')} "
            f"({', '.join(recorded.get('architectures') or ['?'])}), but the target given is {target_path} "
            f"({', '.join(given['architectures']) or '?'}): its {' and '.join(differs)} differ "
            f"({Path(directory) / PROVENANCE_FILE})")


def check_target(directory: str | Path, target_path: str | Path | None, allow_other_target: bool = False,
                 remedy: str = ALLOW_OTHER_TARGET) -> None:
    """Refuse a head used with another target, naming both and ``remedy`` (what to do, where the command has no
    ``--allow-other-target``); ``allow_other_target`` only warns."""
    if target_path is None:
        return
    why = target_mismatch(directory, target_path)
    if why is None:
        return
    if allow_other_target:
        warnings.warn(f"{why}; going on because other targets are allowed", stacklevel=2)
        return
    raise OtherTargetError(f"{why}. A head accepts almost nothing on a target it was not trained for; {remedy}")
