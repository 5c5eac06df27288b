"""``headstart plan``: what a recipe's training step needs per GPU, from the recipe and the target's config.json alone.

The target and the head are built on the meta device (shapes, no weights: nothing is loaded or allocated), so the
parameter counts are exact. Memory is a model, by part: the target's weights; its forward's largest transient; the
features a step captures; the target's distribution on the head's vocab; the head's weights, gradients and AdamW
states (sharded as the backend shards them); the head's activations and loss chunks (each head's own estimate,
``activation_bytes``); and the runtime (torch and its libraries on a CPU; the CUDA context and communication buffers
on a GPU). With a sharded target it counts the two layers FSDP2 holds gathered (the one running and the prefetched next);
it does not model the allocator's fragmentation or the head's own all-gather buffers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from headstart.heads.registry import build_head
from headstart.models.target import Target, dtype_of, text_config
from headstart.trainer.config import RunConfig
from headstart.trainer.feature_store import Storage

GIB = 2**30
RUNTIME_BYTES = {"cpu": int(0.55 * GIB), "cuda": int(1.5 * GIB)}
"""A process's memory before any tensor: on a CPU, the resident size of a Python process that imported torch,
transformers, datasets and headstart's trainer (0.54 GiB measured on torch 2.13); on a GPU, the CUDA context, NCCL's
buffers and the caching allocator's first blocks (a typical figure, not measured here)."""
OPTIMIZER_BYTES = 4 + 4 + 8
"""Per trainable parameter: its float32 value, its gradient and AdamW's two moments (Muon keeps one moment on the
hidden matrices: this is its upper bound)."""


@dataclass
class MemoryPlan:
    parts: list[tuple[str, int]]
    """(what, bytes per GPU) of a training step's peak."""
    gpus: int
    device: str
    gpu_bytes: int | None
    target_params: int
    head_params: int
    """Trainable parameters of the head."""
    tokens_per_micro_batch: int
    tokens_per_step: int
    store_bytes_per_token: int
    advice: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(size for _, size in self.parts)

    @property
    def fits(self) -> bool | None:
        return None if self.gpu_bytes is None else self.total <= self.gpu_bytes

    def render(self, recipe: str) -> str:
        where = f"{self.gpus} GPU{'s' if self.gpus > 1 else ''}" if self.device == "cuda" else \
            f"{self.gpus} CPU process{'es' if self.gpus > 1 else ''}"
        lines = [f"{recipe} on {where}",
                 f"target: {self.target_params / 1e9:.2f}B parameters; head: {self.head_params / 1e6:.1f}M trainable",
                 f"tokens per micro-batch and {'GPU' if self.device == 'cuda' else 'process'}: "
                 f"{self.tokens_per_micro_batch:,}; per optimizer step: {self.tokens_per_step:,}",
                 f"peak memory of a training step, per {'GPU' if self.device == 'cuda' else 'process'}:"]
        width = max(len(name) for name, _ in self.parts) + 2
        lines += [f"  {name:<{width}}{size / GIB:8.2f} GiB" for name, size in self.parts]
        total = f"  {'total':<{width}}{self.total / GIB:8.2f} GiB"
        if self.gpu_bytes is not None:
            total += (f" of {self.gpu_bytes / GIB:.0f}: fits ({(self.gpu_bytes - self.total) / GIB:.1f} GiB to spare)"
                      if self.fits else f" of {self.gpu_bytes / GIB:.0f}: does NOT fit")
        lines.append(total)
        lines.append(f"offline feature store (features.path): {self.store_bytes_per_token:,} bytes a token on disk, "
                     f"{self.store_bytes_per_token * 1e6 / 1e9:.1f} GB per million tokens")
        lines += [f"to fit: {a}" for a in self.advice]
        return "\n".join(lines)


def meta_target_and_head(config: RunConfig, target_config) -> tuple[Target, torch.nn.Module]:
    """The target and a fresh head on the meta device: every shape and parameter, no memory."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(target_config, dtype=dtype_of(config.target.dtype))
        target = Target(model, config.target.aux_layer_ids)
        head = build_head(config.draft, target, torch.ones(target.vocab_size))
    return target, head


def read_target_config(config: RunConfig, target_config: str | None):
    """The target's config.json: ``target_config`` (a file or a directory) or the recipe's target.path."""
    where = Path(target_config or config.target.path)
    directory = where.parent if where.is_file() else where
    if not (directory / "config.json").is_file():
        raise ValueError(f"no config.json in {directory}: give the target's config with --target-config (e.g. "
                         "configs/llama3.1-8b/config.json) or --target.path=DIR")
    return AutoConfig.from_pretrained(str(directory))


def zero_stage(config: RunConfig) -> int:
    return int(json.loads(Path(config.parallel.deepspeed_config).read_text()).get("zero_optimization", {}).get("stage", 0))


def plan(config: RunConfig, gpus: int, gpu_memory_gib: float | None = None, target_config: str | None = None,
         device: str | None = None, tokens: int | None = None) -> MemoryPlan:
    """The per-GPU (per-process on a CPU) memory of one training step of ``config`` on ``gpus`` ranks: with micro-batches
    as full as the recipe allows (``data.tokens_per_batch``, else ``batch_size`` x ``max_length``: a bound), or of
    ``tokens`` tokens (what a run's largest micro-batch held, when the data's conversations are shorter)."""
    if gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {gpus}")
    device = device or ("cuda" if config.target.device.startswith("cuda") else "cpu")
    hf_config = read_target_config(config, target_config)
    target, head = meta_target_and_head(config, hf_config)
    tc = text_config(target.config)
    H, n_aux = tc.hidden_size, len(target.aux_layer_ids)
    intermediate = getattr(tc, "intermediate_size", 4 * H)
    target_bytes = dtype_of(config.target.dtype).itemsize
    act_bytes = 2 if device == "cuda" and config.train.mixed_precision in ("auto", "bf16", "bfloat16") else 4
    T = tokens or config.data.pack_tokens(config.train.batch_size) or config.train.batch_size * config.data.max_length
    offline = config.features.path is not None
    needs = head.needs
    vocab = head.target_vocab_ids().numel()

    target_params = sum(p.numel() for p in target.model.parameters())
    shared = {id(p) for p in target.model.parameters()}
    trainable = sum(p.numel() for p in head.parameters() if p.requires_grad)
    frozen_own = sum(p.numel() * p.element_size() for p in head.parameters() if not p.requires_grad and id(p) not in shared)

    parts: list[tuple[str, int]] = [(f"runtime ({'CUDA context, NCCL' if device == 'cuda' else 'torch and libraries'})",
                                     RUNTIME_BYTES[device])]
    if offline:  # the store replaces the target's layers: only its embedding and lm_head are read
        embed = target.embed_tokens.weight.numel()
        head_w = 0 if target.config.tie_word_embeddings else target.lm_head.weight.numel()
        parts.append(("target embedding and lm_head (offline)", (embed + head_w) * target_bytes))
    else:
        sharded = config.parallel.shard_target and config.parallel.backend == "fsdp" and gpus > 1
        parts.append((f"target weights{' (sharded)' if sharded else ''}",
                      target_params * target_bytes // (gpus if sharded else 1)))
        if sharded:  # FSDP2 gathers a layer whole for its forward and prefetches the next one: two at a time
            layer = sum(p.numel() for p in target.layers[0].parameters())
            parts.append(("target layers gathered (this one and the next)", 2 * layer * target_bytes))
        parts.append(("target forward, one layer's transient", T * (4 * H + 3 * intermediate) * target_bytes))
    captured = (n_aux * needs.aux_hidden_states + needs.last_hidden_state) * T * H * target_bytes
    if captured:
        parts.append(("captured features (" + ", ".join(
            w for w, n in (("aux states", needs.aux_hidden_states), ("final hidden", needs.last_hidden_state)) if n) + ")",
            captured))
    if needs.draft_vocab_logits:
        parts.append((f"target distribution on the head's {vocab:,}-token vocab", T * vocab * 4 * 2))
    if config.parallel.backend == "deepspeed" and zero_stage(config) < 3:  # ZeRO-1/2: parameters replicated
        states = trainable * 4 + trainable * (OPTIMIZER_BYTES - 4) // gpus
    else:  # FSDP2 and ZeRO-3 shard parameters, gradients and optimizer states
        states = trainable * OPTIMIZER_BYTES // gpus
    parts.append(("head weights, gradients, optimizer states", states + frozen_own))
    parts += list(head.activation_bytes(T, config.train.batch_size, act_bytes).items())

    storage = Storage.for_head(needs, config.features.aux, config.features.target_dist, config.features.topk,
                               config.features.hidden)
    result = MemoryPlan(parts=parts, gpus=gpus, device=device,
                        gpu_bytes=None if gpu_memory_gib is None else int(gpu_memory_gib * GIB),
                        target_params=target_params, head_params=trainable, tokens_per_micro_batch=T,
                        tokens_per_step=T * gpus * config.train.grad_accum,
                        store_bytes_per_token=storage.bytes_per_token(H, n_aux))
    if result.fits is False:
        result.advice = advice(result, config, offline)
    return result


def advice(result: MemoryPlan, config: RunConfig, offline: bool) -> list[str]:
    """The recipe fields that shrink the largest parts, largest first."""
    over = result.total - (result.gpu_bytes or 0)
    out = []
    for name, size in sorted(result.parts, key=lambda part: -part[1]):
        if name.startswith("target weights") and not offline:
            if config.parallel.backend == "fsdp" and not config.parallel.shard_target and result.gpus > 1:
                out.append(f"parallel.shard_target: true (the target's weights over {result.gpus} GPUs: "
                           f"-{size * (1 - 1 / result.gpus) / GIB:.1f} GiB)")
            out.append("features.path: train offline from stored features (the target's layers are not loaded)")
        elif name.startswith(("head activations", "captured", "target distribution", "target forward", "attention")):
            field_name = "data.tokens_per_batch" if config.data.packing else "train.batch_size"
            out.append(f"{field_name}: halve it and double train.grad_accum (the same global batch; tokens-bound parts "
                       "halve)")
        elif name.startswith("head weights") and result.gpus == 1:
            out.append("more GPUs: the head's states are sharded over them")
        elif name == "loss chunks":
            out.append("draft.loss_chunk_tokens: fewer positions per block of the vocab loss")
    out = list(dict.fromkeys(out))
    return out[:3] + [f"{over / GIB:.1f} GiB over"]
