"""MTP: a DeepSeek-V3-style multi-token-prediction layer trained against the frozen target.

    step j (j = 0..K-1), at position t, rotary position t+j (vLLM's proposer keeps the target's
    positions and shifts the tokens: the pair (h_t, x_{t+1}) sits at t, and one further per step):
        x        = eh_proj(cat(enorm(embed(token_{t+1+j})), hnorm(h_j)))     # [B, T, H] from [B, T, 2H]
        h_{j+1}  = block(x)           one decoder layer of the target's own architecture and HF class
        logits_j = lm_head(norm(h_{j+1}))                                    # predicts token t+2+j
    h_0 = the target's final hidden state at t (after its final norm, as vLLM and SGLang pass it);
    embed and lm_head are the target's, frozen and shared; the embedding at position 0 (the first
    pair, x_1) is zeroed, as vLLM's and SGLang's DeepSeek MTP do.

Recurrent drafting (k > 1 reuses the layer and feeds h_{j+1} back) is trained the way it is used:
``draft.ttt_steps`` steps, a query of step j at t attending to step 0's keys at positions <= t and to its
own position in steps 1..j -- the pattern the drafter sees at inference (EAGLE-3's training-time
test) -- with the steps' keys kept in a cache, as at inference. The loss is the target's own
distribution at t+1+j over its full vocab (models/vocab_loss.py: chunked, recomputed in backward).

Layouts (docs/FORMATS.md section D): a target that ships MTP tensors -- DeepSeek-V3
(``model.layers.{N}.*``, N = num_hidden_layers) or Qwen3-Next (``mtp.*``) -- is read from and
written back to its own checkpoint (heads/mtp/checkpoint.py); a fresh layer for a dense target is
saved in headstart's own layout (``HeadstartMTP``: config.json + model.safetensors), which no
server loads (docs/FORMATS.md, the MTP section).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from torch.profiler import record_function
from transformers import AttentionInterface, AutoModelForCausalLM, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from headstart.models.head import (DraftConfig, FeatureNeeds, Features, check_layout, layer_activation_bytes,
                                   loss_chunk_bytes, shift_left)
from headstart.models.ttt_attention import ttt_attention
from headstart.heads.mtp.checkpoint import MARKER, find_native_layout, fuse_experts, head_name, write_target_with_mtp
from headstart.models.target import additive_mask, cache_keyword, decoder_layers, text_config
from headstart.models.target_matrices import weight_files
from headstart.models.vocab_loss import VocabProjection, multi_step_loss

@dataclass(frozen=True)
class MTPOptions:
    """An MTP recipe's own ``draft:`` fields."""

    ttt_steps: int = 3
    """Unrolled recurrent steps: step j feeds the layer's own output back and predicts token t+2+j."""
    step_weight: float = 0.8
    """Loss weight of unrolled step k is step_weight**k."""


@dataclass(frozen=True)
class MTPConfig:
    hidden_size: int
    vocab_size: int
    layer_index: int  # N = the target's num_hidden_layers: where DeepSeek numbers its MTP layer
    layout: str = "headstart"  # deepseek | qwen3_next | headstart (a dense target's fresh layer)

    def __post_init__(self) -> None:
        if self.layout not in ("deepseek", "qwen3_next", "headstart"):
            raise ValueError(f"MTP layout must be deepseek, qwen3_next or headstart, got {self.layout!r}")

    @classmethod
    def from_target(cls, target_config, layout: str = "headstart") -> "MTPConfig":
        tc = text_config(target_config)
        return cls(tc.hidden_size, tc.vocab_size, tc.num_hidden_layers, layout)

    def check_target(self, target_config, where: str = "the MTP config") -> None:
        tc = text_config(target_config)
        problems = [f"{k} {mine} != target {k} {theirs}" for k, mine, theirs in (
            ("hidden_size", self.hidden_size, tc.hidden_size), ("vocab_size", self.vocab_size, tc.vocab_size),
            ("num_hidden_layers", self.layer_index, tc.num_hidden_layers)) if mine != theirs]
        if problems:
            raise ValueError(f"{where}: the MTP layer does not fit the target:\n  " + "\n  ".join(problems))


class TTTMask:
    """Passed as the layer's ``attention_mask`` during the training unroll instead of the additive mask
    [T, (j+1)T]: the keys are j+1 steps of T positions, and step j's queries see step 0's causally and their
    own position in steps 1..j. ``ttt_or_sdpa_attention`` then runs models/ttt_attention.py: memory linear in
    T (blocks on CPU, flex_attention on a GPU), where the additive mask and SDPA's scores are quadratic.
    ``documents`` [B, T]: a packed batch's document per position (models/head.py), else None."""

    def __init__(self, documents: torch.Tensor | None = None) -> None:
        self.documents = documents


def ttt_or_sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask, scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """The MTP block's attention (registered with transformers as ``headstart_ttt``): the TTT pattern for a
    ``TTTMask``, transformers' own SDPA for any other mask (drafting, with its KV cache)."""
    if not isinstance(attention_mask, TTTMask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    T, rep = query.shape[2], query.shape[1] // key.shape[1]
    keys = [k.repeat_interleave(rep, dim=1) for k in key.split(T, dim=2)]  # step 0's keys, then steps 1..j
    values = [v.repeat_interleave(rep, dim=1) for v in value.split(T, dim=2)]
    out = ttt_attention(query, keys, values, block=TTT_BLOCK, scale=scaling, documents=attention_mask.documents)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("headstart_ttt", ttt_or_sdpa_attention)
TTT_BLOCK = 512  # query rows per checkpointed block (models/ttt_attention.py)


def block_config(target_config, layer_index: int):
    """The target's text config, extended so that a decoder layer at ``layer_index`` can be built
    (a per-layer ``layer_types`` list gets full attention there, as MTP layers use)."""
    cfg = copy.deepcopy(text_config(target_config))
    types = getattr(cfg, "layer_types", None)
    if isinstance(types, list) and len(types) <= layer_index:
        cfg.layer_types = types + ["full_attention"] * (layer_index + 1 - len(types))
    # An explicit pattern is needed (TTT is not causal): SDPA with masks, and the memory-linear TTT attention
    # in training. A model whose attention softcaps its scores (Gemma 2) keeps its eager form and the mask.
    cfg._attn_implementation = "eager" if getattr(cfg, "attn_logit_softcapping", None) else "headstart_ttt"
    return cfg


class MTPHead(nn.Module):
    """One MTP layer. ``layer_cls``, ``norm_cls`` and ``rotary_cls`` are the target's own HF classes."""

    needs = FeatureNeeds(last_hidden_state=True)
    compiled = ("fuse", "norm", "block.input_layernorm", "block.post_attention_layernorm", "block.mlp")
    """What ``train.compile`` compiles (models/train_compile.py): the fusion and the block around its attention."""

    def __init__(self, config: MTPConfig, target_config, layer_cls: type, norm_cls: type, rotary_cls: type,
                 unroll: int = 3, step_weight: float = 0.8, chunk_tokens: int = 1024, divergence: str = "kl") -> None:
        super().__init__()
        self.divergence = divergence  # DraftConfig.loss (models/vocab_loss.py divergence_sum)
        if unroll < 1:
            raise ValueError(f"MTP unroll (draft.ttt_steps) must be >= 1, got {unroll}")
        self.config, self.unroll_steps, self.step_weight, self.chunk_tokens = config, unroll, step_weight, chunk_tokens
        cfg = block_config(target_config, config.layer_index)
        H, eps = config.hidden_size, getattr(cfg, "rms_norm_eps", 1e-6)
        self.embed_tokens = nn.Embedding(config.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)
        self.enorm, self.hnorm, self.norm = norm_cls(H, eps=eps), norm_cls(H, eps=eps), norm_cls(H, eps=eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.block = layer_cls(cfg, layer_idx=config.layer_index)  # MoE, attention type etc. as layer N would be
        self.block_attention = cfg._attn_implementation
        self.cache_keyword = cache_keyword(layer_cls)  # the block's KV-cache keyword in this transformers version
        for module in self.block.modules():  # its KV lives at index 0 of the head's own one-layer cache
            if hasattr(module, "layer_idx"):
                module.layer_idx = 0
        self.rotary_emb = rotary_cls(config=cfg)
        self.lm_head: Callable[[torch.Tensor], torch.Tensor] | None = None  # the target's, shared and frozen
        self.lm_head_dtype = torch.float32
        # What the server that runs this layout does (read from vLLM's qwen3_next_mtp.py / deepseek_mtp.py):
        # Qwen3-Next feeds the *normed* output to the next step and to lm_head, and keeps position 0's
        # embedding; DeepSeek (and headstart's own layout) feeds the un-normed output back, norms it only
        # for the logits, and zeroes the embedding at position 0.
        self.feeds_normed = config.layout == "qwen3_next"
        self.zero_first_embedding = config.layout != "qwen3_next"
        self.source: str | None = None  # the target checkpoint a native layer was read from (written back into a copy)

    @classmethod
    def for_target(cls, target, config: MTPConfig | None = None, **kwargs) -> "MTPHead":
        """Built from a ``Target``'s own classes, its embedding and lm_head attached."""
        config = config or MTPConfig.from_target(target.config)
        config.check_target(target.config)
        head = cls(config, target.config, *target_classes(target), **kwargs)
        with torch.no_grad():
            head.embed_tokens.weight.copy_(target.embed_tokens.weight.to(head.embed_tokens.weight.dtype))
        head.set_lm_head(target.vocab_head(), target.lm_head_weight.dtype)
        return head

    def set_lm_head(self, vocab_head: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype) -> None:
        """The target's lm_head as a function [..., H] -> [..., V] and its dtype."""
        self.lm_head, self.lm_head_dtype = vocab_head, dtype

    def target_vocab_ids(self) -> torch.Tensor:
        return torch.arange(self.config.vocab_size, device=self.eh_proj.weight.device)

    # -- the layer ------------------------------------------------------------------------------
    def fuse(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """eh_proj(cat(enorm(embed(tokens)), hnorm(hidden))): tokens [B, n], hidden [B, n, H], positions [B, n]."""
        embeds = self.embed_tokens(tokens).to(self.eh_proj.weight.dtype)
        if self.zero_first_embedding:
            embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0.0)  # as DeepSeek's servers do
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden.to(self.eh_proj.weight.dtype))], dim=-1))

    def layer(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:
        """The decoder block on x [B, n, H] at rotary ``positions`` [B, n] under an additive ``mask``
        [B or 1, 1, n, S] over the cache's keys (its new ones included) -> the state the next step reads."""
        mask = mask if isinstance(mask, TTTMask) else mask.to(x.dtype)
        out = self.block(x, attention_mask=mask, position_ids=positions, use_cache=True,
                         position_embeddings=self.rotary_emb(x, positions), **{self.cache_keyword: cache})
        out = out[0] if isinstance(out, tuple) else out
        return self.norm(out) if self.feeds_normed else out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """A step's state [..., H] (``layer``'s output) -> the target's lm_head over the normed output: [..., V]."""
        return self.lm_head((hidden if self.feeds_normed else self.norm(hidden)).to(self.lm_head_dtype))

    # -- training -------------------------------------------------------------------------------
    def activation_bytes(self, tokens: int, sequences: int, element_bytes: int) -> dict[str, int]:
        """headstart plan: every unrolled step runs the target-architecture block over all tokens, plus the fused
        [embedding, hidden] input; an MoE block is counted as dense at its ``intermediate_size`` (rough); the loss
        is over the full vocab."""
        H = self.config.hidden_size
        intermediate = getattr(self.block.mlp, "intermediate_size", None) or 4 * H
        per_step = layer_activation_bytes(tokens, H, intermediate, element_bytes) + tokens * 2 * H * element_bytes
        return {f"head activations ({self.unroll_steps} unrolled steps)": self.unroll_steps * per_step,
                "loss chunks": loss_chunk_bytes(self.chunk_tokens, self.config.vocab_size, tokens)}

    def forward(self, features: Features) -> tuple[torch.Tensor, dict[str, float]]:
        return self.loss(features)

    def unroll(self, f: Features):
        """Yield each step's layer output h_{j+1} [B, T, H]: at position t, step j read token t+1+j and
        h_j (h_0 = the target's final hidden state); its logits predict token t+2+j."""
        B, T = f.input_ids.shape
        device = f.input_ids.device
        base, documents = f.positions(), f.documents()  # a packed batch: each document from position 0
        linear = self.block_attention == "headstart_ttt"  # else the additive mask, quadratic in T
        causal = None if linear else torch.ones(T, T, dtype=torch.bool, device=device).tril()  # step 0: causal
        diagonal = None if linear else torch.eye(T, dtype=torch.bool, device=device)  # steps 1..j: own position
        if documents is not None and not linear:
            causal = causal & (documents[:, :, None] == documents[:, None, :])  # [B, T, T]
            diagonal = diagonal.expand(B, T, T)
        cache, hidden = DynamicCache(), f.last_hidden_state
        for j in range(self.unroll_steps):
            positions = base + j
            mask = TTTMask(documents) if linear else additive_mask(torch.cat([causal] + [diagonal] * j, dim=-1),
                                                                   self.eh_proj.weight.dtype)  # [1, 1, T, (j+1)T]
            with record_function("head: draft step"):  # a part of the step for torch.profiler
                hidden = self.layer(self.fuse(shift_left(f.input_ids, 1 + j, 0), hidden, positions), positions, mask, cache)
            yield hidden

    def loss(self, f: Features) -> tuple[torch.Tensor, dict[str, float]]:
        if f.last_hidden_state is None:
            raise ValueError("the MTP layer reads the target's final hidden state; the features carry none")
        if self.lm_head is None:
            raise ValueError("the MTP layer needs the target's lm_head (set_lm_head)")
        weight = getattr(self.lm_head, "linear_weight", None)  # the target's lm_head, when a plain projection
        project = self.logits if weight is None else VocabProjection(
            lambda h: (h if self.feeds_normed else self.norm(h)).to(self.lm_head_dtype), weight)
        return multi_step_loss(((project, hidden) for hidden in self.unroll(f)), f, self.lm_head, True,
                               self.step_weight, self.chunk_tokens, divergence=self.divergence)

    # -- headstart's own layout (dense targets) --------------------------------------------------
    def export_state_dict(self, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The trained tensors (the target's embedding is not the head's to save)."""
        state = self.state_dict() if state is None else state
        return {k: v.detach().to("cpu").contiguous() for k, v in state.items() if not k.startswith("embed_tokens.")}

    @property
    def layouts(self) -> tuple[str, ...]:
        return (self.config.layout,)  # the target's own (deepseek, qwen3_next), else headstart's

    def save_pretrained(self, directory: str | Path, dtype: torch.dtype = torch.bfloat16,
                        state_dict: dict[str, torch.Tensor] | None = None, layout: str | None = None,
                        verifier: dict | None = None) -> None:
        """Native layouts are written back into a copy of the target (heads/mtp/checkpoint.py);
        a dense target's layer goes to headstart's own layout."""
        check_layout(self, layout)
        tensors = state_dict if state_dict is not None else self.export_state_dict()
        if self.config.layout != "headstart":
            write_target_with_mtp(self.source, directory, tensors, self.config.layout, self.config.layer_index)
            return
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()},
                  str(directory / "model.safetensors"), metadata={"format": "pt"})
        (directory / "config.json").write_text(json.dumps({
            "architectures": ["HeadstartMTP"], "model_type": "headstart_mtp", "hidden_size": self.config.hidden_size,
            "vocab_size": self.config.vocab_size, "layer_index": self.config.layer_index, "unroll": self.unroll_steps,
            "torch_dtype": str(dtype).removeprefix("torch."),
            "note": "headstart's own layout for an MTP layer on a dense target; no server loads it (see headstart docs/FORMATS.md)"}, indent=2))

    @classmethod
    def load(cls, directory: str | Path, target) -> "MTPHead":
        """An MTP layer for ``target``: from a target checkpoint that carries one (native layouts) or
        from headstart's own layout; refused by name if it does not fit."""
        directory = Path(directory)
        if find_native_layout(directory, text_config(target.config).num_hidden_layers) is not None:
            return read_native_mtp(directory, target)
        path = directory / "config.json"
        if not path.is_file() or not (directory / "model.safetensors").is_file():
            raise FileNotFoundError(f"{directory}: neither a target checkpoint with MTP tensors nor an MTP layer in "
                                    "headstart's layout (config.json + model.safetensors)")
        d = json.loads(path.read_text())
        if d.get("architectures") != ["HeadstartMTP"]:
            raise ValueError(f"{path}: not an MTP layer in headstart's layout (architectures={d.get('architectures')})")
        config = MTPConfig(d["hidden_size"], d["vocab_size"], d["layer_index"], "headstart")
        config.check_target(target.config, str(path))
        head = cls.for_target(target, config, unroll=d.get("unroll", 3))
        load_tensors(head, load_file(str(directory / "model.safetensors")), str(directory / "model.safetensors"))
        return head


def load_tensors(head: MTPHead, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Strictly: every trained tensor present with its shape, nothing unknown."""
    expected = head.export_state_dict()
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    bad = [k for k in set(expected) & set(tensors) if tuple(tensors[k].shape) != tuple(expected[k].shape)]
    if missing or unexpected or bad:
        raise ValueError(f"{where}: tensors do not match this target's MTP layer: missing {missing[:6]}, unexpected "
                         f"{unexpected[:6]}, wrong shape {bad[:6]}")
    head.load_state_dict({k: v.to(expected[k].dtype) for k, v in tensors.items()}, strict=False)


def read_native_mtp(directory: str | Path, target, **kwargs):
    """The MTP layer stored in the target checkpoint ``directory``, as an ``MTPHead`` for ``target``."""
    root = Path(directory)
    n_layers = text_config(target.config).num_hidden_layers
    layout = find_native_layout(root, n_layers)
    if layout is None:
        raise ValueError(f"{root}: no MTP tensors of a known layout ({', '.join(m.format(N=n_layers) for m in MARKER.values())})")
    head = MTPHead.for_target(target, MTPConfig.from_target(target.config, layout), **kwargs)
    files = weight_files(root)
    mine = {n: head_name(n, layout, n_layers) for n in files}
    mine = {native: name for native, name in mine.items() if name is not None}
    quantized = [n for n in mine if n.endswith("weight_scale_inv")]
    if quantized:
        raise ValueError(f"{root}: the MTP layer is FP8 block-quantized ({quantized[0]}); headstart trains it in "
                         "bf16 -- dequantize the checkpoint first")
    by_file: dict[Path, list[str]] = {}
    for native in mine:
        by_file.setdefault(files[native], []).append(native)
    tensors = {}
    for path, names in by_file.items():  # one open per shard
        with safe_open(str(path), framework="pt") as f:
            for native in names:
                tensors[mine[native]] = f.get_tensor(native)
    expected = head.export_state_dict()
    load_tensors(head, {k: v for k, v in fuse_experts(tensors).items() if k in expected}, f"{root} ({layout} MTP layer)")
    head.source = str(root.resolve())
    return head


def target_classes(target) -> tuple[type, type, type]:
    """The target's decoder layer, norm and rotary classes. A ``TargetMatrices`` (offline: no model)
    builds the architecture on the meta device, which allocates nothing, to learn them."""
    model = getattr(target, "model", None)
    if model is None:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(target.config)
    layers = decoder_layers(model)
    base = next(m for m in model.modules() if any(c is layers for c in m.children()))  # the module holding the layers
    return type(layers[-1]), type(base.norm), type(base.rotary_emb)


def build_mtp(target, unroll: int = 3, step_weight: float = 0.8, chunk_tokens: int = 1024,
              divergence: str = "kl") -> MTPHead:
    """The MTP layer to train for ``target``: the one its checkpoint ships (DeepSeek-V3, Qwen3-Next
    layouts), or a fresh one whose decoder block starts as a copy of the target's last layer."""
    n_layers = text_config(target.config).num_hidden_layers
    if target.path and find_native_layout(target.path, n_layers) is not None:
        return read_native_mtp(target.path, target, unroll=unroll, step_weight=step_weight, chunk_tokens=chunk_tokens,
                               divergence=divergence)
    head = MTPHead.for_target(target, unroll=unroll, step_weight=step_weight, chunk_tokens=chunk_tokens,
                              divergence=divergence)
    last = fuse_experts(target.layer_state(n_layers - 1))  # read from safetensors (offline), experts are per-expert
    mine = head.block.state_dict()
    if set(last) == set(mine) and all(last[k].shape == mine[k].shape for k in mine):
        head.block.load_state_dict(last)
    else:  # the last layer is of another kind (e.g. linear attention): HF's initialisation, stated
        std = getattr(text_config(target.config), "initializer_range", 0.02)
        with torch.no_grad():
            for p in head.block.parameters():
                if p.dim() >= 2:  # matrices and fused experts (allocated uninitialised by their class)
                    p.normal_(0.0, std)
        print(f"MTP: the target's last layer does not match the MTP block (differs in "
              f"{sorted(set(last) ^ set(mine))[:4]}); the block starts from a normal({std}) initialisation")
    return head


def build_mtp_head(draft: DraftConfig, target, token_counts: torch.Tensor | None = None) -> MTPHead:
    """``build_mtp`` from a recipe's draft section (the token counts are not used: MTP predicts the full vocab)."""
    options = draft.options or MTPOptions()
    return build_mtp(target, options.ttt_steps, options.step_weight, draft.loss_chunk_tokens, draft.loss)

