"""MTP layers that live inside a target's own checkpoint (docs/FORMATS.md section D).

transformers drops these tensors when it loads the target, so they are read from the safetensors
files directly, and written back as a new target directory that a server loads as the target:
its weight shards linked (a real target is hundreds of GB), the fine-tuned MTP tensors in a shard
of their own under their original names, and an updated ``model.safetensors.index.json``.

    DeepSeek-V3 / R1 (num_nextn_predict_layers):  model.layers.{N}.{enorm,hnorm,eh_proj}.weight,
        model.layers.{N}.shared_head.norm.weight, model.layers.{N}.<decoder layer>; N = num_hidden_layers
        (model.layers.{N}.embed_tokens / shared_head.head are copies of the target's: kept as they are)
    Qwen3-Next:  mtp.fc.weight, mtp.pre_fc_norm_{embedding,hidden}.weight, mtp.norm.weight, mtp.layers.0.<layer>

MoE experts are stored one tensor per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``) while
transformers holds them fused (``mlp.experts.gate_up_proj`` [E, 2I, H] = cat(gate, up) on dim 1,
``mlp.experts.down_proj`` [E, H, I]): ``split_experts`` / ``fuse_experts`` convert between the two.
FP8 block-quantized layers (``weight_scale_inv``) are refused: dequantize such a checkpoint first.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from headstart.models.files import share_like_umask
from headstart.models.target_matrices import weight_files

NATIVE = {
    # head tensor prefix -> native prefix ("{N}" = the MTP layer's index)
    "deepseek": {"enorm.": "model.layers.{N}.enorm.", "hnorm.": "model.layers.{N}.hnorm.",
                 "eh_proj.": "model.layers.{N}.eh_proj.", "norm.": "model.layers.{N}.shared_head.norm.",
                 "block.": "model.layers.{N}."},
    "qwen3_next": {"enorm.": "mtp.pre_fc_norm_embedding.", "hnorm.": "mtp.pre_fc_norm_hidden.", "eh_proj.": "mtp.fc.",
                   "norm.": "mtp.norm.", "block.": "mtp.layers.0."},
}
MARKER = {"deepseek": "model.layers.{N}.eh_proj.weight", "qwen3_next": "mtp.fc.weight"}


def split_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused expert tensors (transformers' in-memory form) -> one tensor per expert (the checkpoint's)."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            stem = name[: -len("gate_up_proj")]
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{stem}{e}.gate_proj.weight"], out[f"{stem}{e}.up_proj.weight"] = gate[e].contiguous(), up[e].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            stem = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{stem}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    return out


def fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One tensor per expert -> transformers' fused expert tensors (the inverse of ``split_experts``)."""
    pattern = re.compile(r"^(.*mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")
    out, experts = {}, {}
    for name, t in tensors.items():
        m = pattern.match(name)
        if m is None:
            out[name] = t
        else:
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
    for stem, parts in experts.items():
        n = 1 + max(e for e, _ in parts)
        try:
            gate, up, down = ([parts[(e, kind)] for e in range(n)] for kind in ("gate", "up", "down"))
        except KeyError as err:
            raise ValueError(f"expert tensors under {stem!r} are incomplete: no {err.args[0]}") from None
        out[f"{stem}gate_up_proj"] = torch.cat([torch.stack(gate), torch.stack(up)], dim=1)
        out[f"{stem}down_proj"] = torch.stack(down)
    return out


def native_name(name: str, layout: str, layer_index: int) -> str:
    for prefix, native in NATIVE[layout].items():
        if name.startswith(prefix):
            return native.format(N=layer_index) + name[len(prefix):]
    raise KeyError(f"MTP tensor {name!r} has no {layout} name")


def head_name(native: str, layout: str, layer_index: int) -> str | None:
    """The head's name of a native MTP tensor (the longest matching prefix), or None if it is not one."""
    matches = [(len(n.format(N=layer_index)), prefix, n.format(N=layer_index)) for prefix, n in NATIVE[layout].items()
               if native.startswith(n.format(N=layer_index))]
    if not matches:
        return None
    _, prefix, stem = max(matches)
    return prefix + native[len(stem):]


def find_native_layout(directory: str | Path, layer_index: int) -> str | None:
    """Which native MTP layout a target checkpoint carries (found by its tensor names), or None."""
    root = Path(directory)
    if not (root / "model.safetensors.index.json").is_file() and not (root / "model.safetensors").is_file():
        return None
    names = set(weight_files(root))
    for layout, marker in MARKER.items():
        if marker.format(N=layer_index) in names:
            return layout
    return None


def detect_mtp(directory: Path, config: dict) -> str | None:
    """The layout of an exported head (or a target checkpoint carrying an MTP layer) whose config.json is
    ``config``, if it is an MTP layer's: headstart's own, or a native one found by its tensor names."""
    if (config.get("architectures") or [None])[0] == "HeadstartMTP":
        return "headstart"
    layers = (config.get("text_config") or config).get("num_hidden_layers", -1)
    return find_native_layout(directory, int(layers))


def write_target_with_mtp(source: str | Path, out: str | Path, tensors: dict[str, torch.Tensor], layout: str,
                          layer_index: int) -> None:
    """A copy of the target checkpoint ``source`` whose MTP layer is ``tensors`` (head names).

    Shards without MTP tensors are linked; a shard with some is rewritten without them (one with
    only MTP tensors is dropped); the new MTP tensors go to ``model-mtp.safetensors`` in the dtype
    the source stored them in; other files (config, tokenizer) are copied."""
    source, out = Path(source), Path(out)
    files = weight_files(source)
    if out.resolve() == source.resolve() or any(out.resolve() in p.resolve().parents for p in files.values()):
        raise ValueError(f"{out}: writing the target with its new MTP layer there would overwrite the files it is read "
                         f"from ({source}); choose another directory")
    replaced = split_experts({native_name(k, layout, layer_index): v for k, v in tensors.items()})
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
    share_like_umask(out)  # the shards written here (0600 from safetensors); the linked ones stay the target's
