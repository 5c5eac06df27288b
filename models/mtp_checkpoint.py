"""MTP layers that live inside a target's own checkpoint (docs/FORMATS.md section D).

transformers drops these tensors when it loads the target, so they are read from the safetensors
files directly, and written back as a new target directory that a server loads as the target:
its weight shards linked (a real target is hundreds of GB), the fine-tuned MTP tensors in a shard
of their own under their original names, and an updated ``model.safetensors.index.json``.

    DeepSeek-V3 / R1 (num_nextn_predict_layers):  model.layers.{N}.{enorm,hnorm,eh_proj}.weight,
        model.layers.{N}.shared_head.norm.weight, model.layers.{N}.<decoder layer>; N = num_hidden_layers
        (model.layers.{N}.embed_tokens / shared_head.head are copies of the target's: kept as they are)
    Qwen3-Next:  mtp.fc.weight, mtp.pre_fc_norm_{embedding,hidden}.weight, mtp.norm.weight, mtp.layers.0.<layer>
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from headstart.models.target import text_config
from headstart.models.target_matrices import _weight_files

NATIVE = {
    # head tensor prefix -> native prefix ("{N}" = the MTP layer's index)
    "deepseek": {"enorm.": "model.layers.{N}.enorm.", "hnorm.": "model.layers.{N}.hnorm.",
                 "eh_proj.": "model.layers.{N}.eh_proj.", "norm.": "model.layers.{N}.shared_head.norm.",
                 "block.": "model.layers.{N}."},
    "qwen3_next": {"enorm.": "mtp.pre_fc_norm_embedding.", "hnorm.": "mtp.pre_fc_norm_hidden.", "eh_proj.": "mtp.fc.",
                   "norm.": "mtp.norm.", "block.": "mtp.layers.0."},
}
MARKER = {"deepseek": "model.layers.{N}.eh_proj.weight", "qwen3_next": "mtp.fc.weight"}


def native_name(name: str, layout: str, layer_index: int) -> str:
    for prefix, native in NATIVE[layout].items():
        if name.startswith(prefix):
            return native.format(N=layer_index) + name[len(prefix):]
    raise KeyError(f"MTP tensor {name!r} has no {layout} name")


def find_native_layout(directory: str | Path, layer_index: int) -> str | None:
    """Which native MTP layout a target checkpoint carries (found by its tensor names), or None."""
    root = Path(directory)
    if not (root / "model.safetensors.index.json").is_file() and not (root / "model.safetensors").is_file():
        return None
    names = set(_weight_files(root))
    for layout, marker in MARKER.items():
        if marker.format(N=layer_index) in names:
            return layout
    return None


def read_native_mtp(directory: str | Path, target, **kwargs):
    """The MTP layer stored in the target checkpoint ``directory``, as an ``MTPHead`` for ``target``."""
    from headstart.models.mtp import MTPConfig, MTPHead, load_tensors

    root = Path(directory)
    n_layers = text_config(target.config).num_hidden_layers
    layout = find_native_layout(root, n_layers)
    if layout is None:
        raise ValueError(f"{root}: no MTP tensors of a known layout ({', '.join(m.format(N=n_layers) for m in MARKER.values())})")
    head = MTPHead.for_target(target, MTPConfig.from_target(target.config, layout), **kwargs)
    files = _weight_files(root)
    tensors, missing = {}, []
    for name in head.export_state_dict():
        native = native_name(name, layout, n_layers)
        if native not in files:
            missing.append(native)
            continue
        with safe_open(str(files[native]), framework="pt") as f:
            tensors[name] = f.get_tensor(native)
    if missing:
        raise ValueError(f"{root}: the {layout} MTP layer lacks {missing[:6]}{' ...' if len(missing) > 6 else ''}")
    load_tensors(head, tensors, str(root))
    head.source = str(root.resolve())
    return head


def write_target_with_mtp(source: str | Path, out: str | Path, tensors: dict[str, torch.Tensor], layout: str,
                          layer_index: int) -> None:
    """A copy of the target checkpoint ``source`` whose MTP layer is ``tensors`` (head names).

    Shards without MTP tensors are linked; a shard with some is rewritten without them (one with
    only MTP tensors is dropped); the new MTP tensors go to ``model-mtp.safetensors`` in the dtype
    the source stored them in; other files (config, tokenizer) are copied."""
    source, out = Path(source), Path(out)
    files = _weight_files(source)
    replaced = {native_name(k, layout, layer_index): v for k, v in tensors.items()}
    unknown = sorted(set(replaced) - set(files))
    if unknown:
        raise ValueError(f"{source} has no tensors named {unknown[:6]}: the MTP layer was not read from this checkpoint")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()  # a re-export (every checkpoint) replaces what an earlier one wrote
    weight_map, dtypes = {}, {}
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    single = source / "model.safetensors"
    for i, (path, names) in enumerate(sorted(by_file.items())):
        mtp_here = [n for n in names if n in replaced]
        keep = [n for n in names if n not in replaced]
        with safe_open(str(path), framework="pt") as f:
            for n in mtp_here:
                dtypes[n] = f.get_slice(n).get_dtype()
            # transformers loads a lone model.safetensors and ignores the index: give it a shard name
            name = f"model-base-{i:05d}.safetensors" if path == single else path.name
            if not keep:
                continue
            if mtp_here:
                save_file({n: f.get_tensor(n) for n in keep}, str(out / name), metadata={"format": "pt"})
            else:
                os.symlink(path.resolve(), out / name)
        weight_map.update({n: name for n in keep})
    torch_dtypes = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn}
    save_file({n: t.to(torch_dtypes.get(dtypes[n], t.dtype)).contiguous() for n, t in replaced.items()},
              str(out / "model-mtp.safetensors"), metadata={"format": "pt"})
    weight_map.update({n: "model-mtp.safetensors" for n in replaced})
    size = sum((out / f).stat().st_size for f in set(weight_map.values()))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    for path in source.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors") and path.name != "model.safetensors.index.json":
            shutil.copy2(path, out / path.name)
