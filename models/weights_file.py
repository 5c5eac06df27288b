"""One head's ``model.safetensors`` + ``config.json``, written and read back with the layout's tensors checked by name:
the writer and reader the heads in their own simple layouts share (Medusa, Hydra)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


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
