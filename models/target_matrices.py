"""The target's embedding and output matrices, read straight from its safetensors files.

Training from stored features never runs the target, but the head still needs the target's token
embeddings (its input) and, when the store keeps final hidden states, the lm_head (the target's
distribution). Reading only those two tensors keeps a 70B target's other weights off the host.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig

from headstart.models.target import (
    TargetConfig,
    dtype_of,
    check_aux_layer_ids,
    chunked_argmax,
    default_aux_layer_ids,
    vocab_head,
)


def weight_files(root: Path) -> dict[str, Path]:
    """tensor name -> file, from the sharded index or the single file."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return {k: root / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    single = root / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{root}: no model.safetensors(.index.json); training from stored features reads the "
                                "target's embeddings from safetensors")
    with safe_open(str(single), framework="pt") as f:
        return {k: single for k in f.keys()}


def _pick(names: list[str], suffix: str) -> str | None:
    found = [n for n in names if n.endswith(suffix)]
    # A multimodal checkpoint may hold several; the language model's is the one we want.
    found.sort(key=lambda n: ("language_model" not in n, len(n)))
    return found[0] if found else None


class TargetMatrices:
    """Quacks like ``Target`` where a head is built (config, aux_layer_ids, embed_tokens, vocab_size)
    and gives the target's logits on a subset of its vocab from a final hidden state."""

    def __init__(self, config: TargetConfig, device: torch.device | str = "cpu") -> None:
        root = Path(config.path)
        if not (root / "config.json").is_file():
            raise FileNotFoundError(f"no HF checkpoint at {config.path!r}: config.json not found")
        self.config = AutoConfig.from_pretrained(root, trust_remote_code=config.trust_remote_code, local_files_only=True)
        text = self.config.get_text_config()
        self.num_layers = text.num_hidden_layers
        self.aux_layer_ids = check_aux_layer_ids(
            default_aux_layer_ids(self.num_layers) if config.aux_layer_ids is None else config.aux_layer_ids, self.num_layers)
        files = weight_files(root)
        embed_name, head_name = _pick(list(files), "embed_tokens.weight"), _pick(list(files), "lm_head.weight")
        if embed_name is None:
            raise ValueError(f"{root}: no '*embed_tokens.weight' tensor in its safetensors; train this target online")
        dtype = dtype_of(config.dtype)

        def read(name: str) -> torch.Tensor:
            with safe_open(str(files[name]), framework="pt") as f:
                return f.get_tensor(name).to(device=device, dtype=dtype)

        embed = read(embed_name)
        self.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
        self.lm_head_weight = read(head_name) if head_name is not None else embed  # tied when absent
        if self.lm_head_weight.shape[1] != text.hidden_size:
            raise ValueError(f"{root}: lm_head is {tuple(self.lm_head_weight.shape)}, hidden size {text.hidden_size}")
        bias_name = head_name[: -len("weight")] + "bias" if head_name else None
        self.lm_head_bias = read(bias_name) if bias_name in files else None
        self.softcap = getattr(text, "final_logit_softcapping", None)
        self.path, self._files, self._dtype, self._device = str(root), files, dtype, device

    def layer_state(self, index: int) -> dict[str, torch.Tensor]:
        """Decoder layer ``index``'s tensors (names relative to the layer), read from the safetensors."""
        marker = f"layers.{index}."
        # A multimodal checkpoint may number several towers' layers; the language model's is the one.
        prefixes = sorted({n[: n.index(marker) + len(marker)] for n in self._files if marker in n},
                          key=lambda p: ("language_model" not in p, len(p)))
        if not prefixes:
            raise ValueError(f"{self.path}: no tensors of decoder layer {index} in its safetensors")
        out = {}
        for n in (n for n in self._files if n.startswith(prefixes[0])):
            with safe_open(str(self._files[n]), framework="pt") as f:
                out[n[len(prefixes[0]):]] = f.get_tensor(n).to(device=self._device, dtype=self._dtype)
        return out

    @property
    def vocab_size(self) -> int:
        return self.lm_head_weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.lm_head_weight.shape[1]

    def vocab_head(self, vocab_ids: torch.Tensor | None = None):
        return vocab_head(self.lm_head_weight, self.lm_head_bias, self.softcap, vocab_ids)

    def argmax(self, last_hidden: torch.Tensor, chunk_tokens: int | None = None) -> torch.Tensor:
        return chunked_argmax(self.vocab_head(), last_hidden, self.vocab_size, chunk_tokens)
