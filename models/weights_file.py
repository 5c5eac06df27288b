"""One head's ``model.safetensors`` + ``config.json``, written and read back with the layout's tensors checked by name:
the writer and reader the heads in their own simple layouts share (Medusa, Hydra)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from headstart.models.errors import UserError


def write_weights(directory: str | Path, tensors: dict[str, torch.Tensor], dtype: torch.dtype, config: dict) -> None:
    """Floating tensors in ``dtype`` (integer ones, e.g. a ``token_map``, as they are) and the config."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()},
              str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def read_weights(directory: str | Path, expected: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """``model.safetensors`` as ``expected``'s names, shapes and dtypes; any tensor missing, unexpected or of the wrong
    shape is refused by name."""
    directory = Path(directory)
    tensors = load_file(str(directory / "model.safetensors"))
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{directory}: tensors do not match the {layout} layout of its config.json: missing {missing}, "
                         f"unexpected {unexpected}")
    bad = [k for k, v in tensors.items() if tuple(v.shape) != tuple(expected[k].shape)]
    if bad:
        raise ValueError(f"{directory}: tensors of the wrong shape: " + ", ".join(
            f"{k} {tuple(tensors[k].shape)} (expected {tuple(expected[k].shape)})" for k in bad))
    return {k: v.to(expected[k].dtype) for k, v in tensors.items()}


def check_safetensors(path: str | Path) -> None:
    """Refuse a ``.safetensors`` file that is cut short (an interrupted copy or download) or is not one, from its
    header alone: no tensor is read. Its header's data offsets must end exactly where the file does."""
    path = Path(path)
    size = path.stat().st_size
    again = "copy or export it again"
    with path.open("rb") as f:
        prefix = f.read(8)
        n = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if n < 2 or n > size - 8:
            raise UserError(f"{path}: cut short or not a safetensors file ({size} bytes, "
                            + (f"its header says {n} bytes of header); {again}" if n >= 0 else f"no header); {again}"))
        try:
            header = json.loads(f.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            raise UserError(f"{path}: not a safetensors file (its header cannot be read); {again}") from None
    if 8 + n + end != size:
        raise UserError(f"{path}: cut short: its header lists {8 + n + end:,} bytes, the file has {size:,}; {again}")
