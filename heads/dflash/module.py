"""DFlash draft head (arXiv 2602.06036), in the layout vLLM and SGLang load (z-lab's ``DFlashDraftModel``).

    ctx     = hidden_norm(fc(cat(target hidden states at aux layers)))       # [C, H], one per committed position
    block   = embed([bonus, MASK, ..., MASK])                               # B tokens at positions p .. p+B-1
    layer:  q, k, v from input_layernorm(block); the keys and values also k_proj/v_proj(ctx) (no norm on ctx),
            q_norm/k_norm per head (Qwen3), rotary at each token's position; block slot i attends to every context
            position before the bonus token and to every slot of its own block (bidirectional); then the MLP
    logits  = lm_head(norm(out))[1:]                                          # slot i predicts the token at p+i

The embedding and lm_head are the target's, frozen and not saved (z-lab's checkpoints carry neither; SGLang always
uses the target's). One forward fills B-1 drafts; the context's keys and values are computed once per committed
token and cached (heads/dflash/drafter.py).

Training draws ``anchors`` positions a per sequence among those whose next token is trained and that have context
before them; block a holds token a and B-1 masks at positions a..a+B-1, sees the target's features at positions < a
of its document, and slot i is trained on the target's distribution for token a+i, weighted by D-PACE or by
exp(-(i-1)/gamma) (``DFlashOptions.weighting``).
"""

from __future__ import annotations

import json
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, apply_rotary_pos_emb

from headstart.heads.dflash.config import DFlashConfig, DFlashOptions
from headstart.models.head import (DraftConfig, FeatureNeeds, Features, StepTally, check_layout, layer_activation_bytes,
                                   loss_chunk_bytes, loss_denominator)
from headstart.models.vocab_loss import VocabProjection, chunked_vocab_loss

KV = tuple[torch.Tensor, torch.Tensor]


@dataclass
class BlockDrafts:
    """One training step's blocks, as the loss reads them (``DFlashDraft.block_drafts``)."""

    anchors: torch.Tensor
    """[B, N] each block's anchor a: its slot 0 holds token a, its context is the target's states before a."""
    drafts: torch.Tensor
    """[B, N, D, H] the layers' output at each block's draft slots: draft j (1-based) predicts the token at a+j."""
    trained: list[torch.Tensor]
    """Per draft j = 1..D: [B, N] whether token a+j is trained (in the sequence, in the loss mask, in a's document)."""


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        h, nh, nkv, hd = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, hd
        self.q_proj = nn.Linear(h, nh * hd, bias=False)
        self.k_proj = nn.Linear(h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.q_norm = Qwen3RMSNorm(hd, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(hd, eps=config.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> KV:
        """x [B, n, H] -> keys (k_norm, rotary) and values [B, nkv, n, hd]."""
        B, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, n, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary_pos_emb(k, k, cos, sin)[0], v

    def forward(self, x: torch.Tensor, context: KV, cos: torch.Tensor, sin: torch.Tensor,
                allowed: torch.Tensor | None) -> torch.Tensor:
        """The block x [B, n, H] attending to the context's keys/values [B, nkv, C, hd] and its own, under ``allowed``
        [B, n, C + n] (None: everything)."""
        B, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, n, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rotary_pos_emb(q, q, cos, sin)[0]
        k, v = self.kv(x, cos, sin)
        keys, values = torch.cat([context[0], k], dim=2), torch.cat([context[1], v], dim=2)
        rep = self.num_heads // self.num_kv_heads
        out = F.scaled_dot_product_attention(q, keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1),
                                             attn_mask=None if allowed is None else allowed.unsqueeze(1))
        return self.o_proj(out.transpose(1, 2).reshape(B, n, -1))


class DFlashLayer(nn.Module):
    """A Qwen3 decoder layer whose attention also reads the context's keys and values."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = Qwen3MLP(config.qwen3_config())
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x: torch.Tensor, context: KV, cos: torch.Tensor, sin: torch.Tensor,
                allowed: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), context, cos, sin, allowed)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraft(nn.Module):
    """The DFlash drafter; ``embed_tokens`` and ``lm_head`` are the target's, frozen and not saved."""

    needs = FeatureNeeds(aux_hidden_states=True, last_hidden_state=True)
    layouts = ("dflash",)  # docs/FORMATS.md section H
    compiled = ("context",)
    """What ``train.compile`` compiles (models/train_compile.py)."""
    layer_class = DFlashLayer
    """The decoder layer (a variant's own subclass: DFlash2's adds its convolutions)."""
    config_class = DFlashConfig
    """The architecture this class reads from an export's config.json (a variant's own subclass)."""
    first_draft_slot = 1
    """The block slot whose output is the first draft. DFlash's slot i (a mask at position a+i) predicts the token at
    a+i, so slot 0 (the bonus token) drafts nothing and a block drafts B-1 tokens; a variant whose slot i predicts the
    next token a+i+1, as a causal LM's position does (DSpark), sets 0 and drafts B."""

    def __init__(self, config: DFlashConfig, anchors: int = 64, decay_gamma: float = 4.0, weighting: str = "dpace",
                 dpace_alpha: float = 0.5) -> None:
        super().__init__()
        if weighting not in ("decay", "dpace"):
            raise ValueError(f"draft.weighting must be decay or dpace, got {weighting!r}")
        if weighting == "dpace" and not 0 < dpace_alpha <= 1:
            raise ValueError(f"draft.dpace_alpha must be in (0, 1], got {dpace_alpha}")
        self.config, self.anchors, self.decay_gamma = config, anchors, decay_gamma
        self.weighting, self.dpace_alpha = weighting, dpace_alpha
        self.chunk_tokens = 1024  # trained slots per [chunk, V] logits block of the loss
        self.divergence = "kl"
        H = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(len(config.aux_layer_ids) * config.target_hidden_size, H, bias=False)
        self.hidden_norm = Qwen3RMSNorm(H, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(config) for _ in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(H, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config.qwen3_config())
        self.lm_head: Callable[[torch.Tensor], torch.Tensor] | None = None  # the target's, shared and frozen
        self.lm_head_dtype = torch.float32

    def activation_bytes(self, tokens: int, sequences: int, element_bytes: int) -> dict[str, int]:
        """headstart plan: each layer runs over the step's blocks (``anchors`` per sequence, at most one per
        position) and keeps the context's keys and values for every token; the loss is over the full vocab."""
        c, b = self.config, element_bytes
        per_sequence = max(1, tokens // max(1, sequences))
        slots = sequences * min(self.anchors, per_sequence) * c.block_size
        kv = 2 * c.num_key_value_heads * c.head_dim
        layers = c.num_hidden_layers * (layer_activation_bytes(slots, c.hidden_size, c.intermediate_size, b)
                                         + tokens * kv * b)
        scores = min(self.anchors, per_sequence) * c.block_size * (per_sequence + c.block_size) \
            * c.num_attention_heads * 4 * 2
        return {f"head activations ({c.num_hidden_layers} layers, {slots} block slots)": layers + 2 * tokens * c.hidden_size * b,
                "attention scores, one sequence": scores,
                "loss chunks": loss_chunk_bytes(self.chunk_tokens, c.vocab_size, slots)}

    @property
    def drafts_per_block(self) -> int:
        """D: the drafts one block fills (B - ``first_draft_slot``)."""
        return self.config.block_size - self.first_draft_slot

    def set_target(self, target) -> None:
        """Take the target's embedding (copied) and lm_head (shared, as a function)."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(target.embed_tokens.weight.to(self.embed_tokens.weight.dtype))
        self.lm_head, self.lm_head_dtype = target.vocab_head(), target.lm_head_weight.dtype

    def target_vocab_ids(self) -> torch.Tensor:
        return torch.arange(self.config.vocab_size, device=self.fc.weight.device)

    # -- the network ----------------------------------------------------------------------------
    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's aux hidden states [B, C, n * H_t] -> the context states [B, C, H]."""
        return self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[KV]:
        """Each layer's keys and values of the context states [B, C, H] at rotary ``positions`` [B, C]."""
        cos, sin = self.rotary_emb(context, positions)
        return [layer.self_attn.kv(context, cos, sin) for layer in self.layers]

    def blocks(self, tokens: torch.Tensor, positions: torch.Tensor, context: list[KV],
               allowed: torch.Tensor | None) -> torch.Tensor:
        """Block tokens [B, n] at rotary ``positions`` [B, n] over each layer's context keys/values -> the last
        layer's output [B, n, H] (what ``logits`` reads)."""
        x = self.embed_tokens(tokens).to(self.fc.weight.dtype)
        cos, sin = self.rotary_emb(x, positions)
        for layer, kv in zip(self.layers, context):
            x = layer(x, kv, cos, sin, allowed)
        return x

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The layers' output [..., H] -> the target's lm_head over its final norm: [..., V]."""
        return self.lm_head(self.norm(out).to(self.lm_head_dtype))

    # -- training -------------------------------------------------------------------------------
    def forward(self, features: Features) -> tuple[torch.Tensor, dict[str, float]]:
        return self.loss(features)

    def pick_anchors(self, f: Features) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to ``anchors`` positions per row, at random among those that have context before them in their
        document and whose next token is trained: (anchors [B, N], which are real [B, N])."""
        B, T = f.input_ids.shape
        pos = f.positions()
        ok = torch.zeros(B, T, dtype=torch.bool, device=f.input_ids.device)
        ok[:, :-1] = f.loss_mask[:, 1:].bool()
        ok = f.within_document(ok, 1) & (pos >= 1)
        counts = ok.sum(1)
        N = int(min(self.anchors, max(int(counts.max()), 1)))
        # a random order of each row's candidates: candidates first (by a random key), then the rest
        keys = torch.rand(B, T, device=ok.device).masked_fill(~ok, 2.0)
        anchors = keys.argsort(dim=1)[:, :N].sort(dim=1).values
        real = ok.gather(1, anchors)
        return anchors, real

    def block_drafts(self, f: Features) -> BlockDrafts:
        """The backbone's half of a training step: anchors drawn (``pick_anchors``), one block per anchor run over its
        document's context, and each block's draft slots with the tokens they are trained on."""
        if f.last_hidden_state is None or f.aux_hidden_states is None:
            raise ValueError(f"the {type(self).__name__} head reads the target's aux hidden states and final hidden state")
        if self.lm_head is None:
            raise ValueError(f"the {type(self).__name__} head needs the target's lm_head (set_target)")
        B, T = f.input_ids.shape
        Bk, device = self.config.block_size, f.input_ids.device
        pos, docs = f.positions(), f.documents()
        anchors, real = self.pick_anchors(f)  # [B, N]
        N = anchors.shape[1]
        slots = torch.arange(Bk, device=device)
        tokens = torch.full((B, N, Bk), self.config.mask_token_id, dtype=torch.long, device=device)
        tokens[:, :, 0] = f.input_ids.gather(1, anchors)
        block_pos = pos.gather(1, anchors)[:, :, None] + slots  # [B, N, Bk]
        # context position c is visible to block a iff c < a in a's document; a block sees all of its own slots
        ctx_ok = torch.arange(T, device=device)[None, None, :] < anchors[:, :, None]  # [B, N, T]
        if docs is not None:
            ctx_ok = ctx_ok & (docs[:, None, :] == docs.gather(1, anchors)[:, :, None])
        own = torch.block_diag(*[torch.ones(Bk, Bk, dtype=torch.bool, device=device)] * N)  # [N*Bk, N*Bk]
        allowed = torch.cat([ctx_ok.repeat_interleave(Bk, dim=1), own.expand(B, -1, -1)], dim=2)
        context = self.context_kv(self.context(f.aux_hidden_states), pos)
        out = self.blocks(tokens.view(B, N * Bk), block_pos.view(B, N * Bk), context, allowed).view(B, N, Bk, -1)
        trained = []  # per draft j >= 1: [B, N], the blocks whose token a+j is trained
        for j in range(1, self.drafts_per_block + 1):
            label = anchors + j  # [B, N]: the token draft j predicts
            ok = real & (label < T) & f.loss_mask.gather(1, label.clamp(max=T - 1)).bool()
            if docs is not None:
                ok = ok & (docs.gather(1, label.clamp(max=T - 1)) == docs.gather(1, anchors))
            trained.append(ok)
        return BlockDrafts(anchors, out[:, :, self.first_draft_slot:], trained)

    def projection(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """Slot outputs [n, H] -> logits [n, V], as a ``VocabProjection`` where the target's lm_head is one matrix (the
        fused loss kernels read it so)."""
        weight = getattr(self.lm_head, "linear_weight", None)
        return (lambda h: self.logits(h).float()) if weight is None else VocabProjection(
            lambda h: self.norm(h).to(self.lm_head_dtype), weight)

    def draft_weights(self, project, blocks: BlockDrafts, f: Features) -> torch.Tensor | None:
        """Each draft's loss weight [B, N, D] (D-PACE), or None: the decay's per-draft constants (``decay``)."""
        return self.dpace_weights(project, blocks, f) if self.weighting == "dpace" else None

    def decay(self, j: int) -> float:
        """Draft j's (1-based) constant weight under ``decay``: exp(-(j-1)/gamma), the first draft 1."""
        return math.exp(-(j - 1) / self.decay_gamma) if self.weighting == "decay" and self.decay_gamma > 0 else 1.0

    def loss(self, f: Features) -> tuple[torch.Tensor, dict[str, float]]:
        """Block-wise loss: draft j of each anchor's block against the target's distribution for token a+j (forward KL
        by default, ``DraftConfig.loss``), weighted by D-PACE or exp(-(j-1)/gamma), summed and divided by
        ``loss_denominator``."""
        blocks = self.block_drafts(f)
        project = self.projection()
        return self.block_loss(blocks, project, self.draft_weights(project, blocks, f), f)

    def block_loss(self, blocks: BlockDrafts, project, weights: torch.Tensor | None, f: Features
                   ) -> tuple[torch.Tensor, dict[str, float]]:
        """``loss`` once the blocks ran and their drafts' weights are known (a variant adds its terms to it)."""
        B, T = f.input_ids.shape
        denominator = loss_denominator(f)
        total = torch.zeros((), dtype=torch.float32, device=f.input_ids.device)
        tally = StepTally()
        for j in range(1, self.drafts_per_block + 1):
            b, n = blocks.trained[j - 1].nonzero(as_tuple=True)
            a = blocks.anchors[b, n]
            w = None if weights is None else weights[b, n, j - 1]
            step_sum, correct, top5, accept = chunked_vocab_loss(
                project, blocks.drafts[b, n, j - 1], self.lm_head, f.last_hidden_state[b, a + j - 1], f.input_ids[b, a + j],
                True, self.chunk_tokens, divergence=self.divergence, full_metrics=f.full_metrics, weights=w)
            # the decay's draft weight; D-PACE's are inside step_sum (its per-slot loss metric is the weighted one)
            total = total + self.decay(j) * step_sum / denominator
            at = torch.zeros(B, T, dtype=torch.bool, device=f.input_ids.device)
            at[b, a] = True
            tally.add(at, b, a, step_sum, correct, top5=top5, accept=accept)
        return total, tally.metrics(f.loss_mask)

    @torch.no_grad()
    def dpace_weights(self, project, blocks: BlockDrafts, f: Features) -> torch.Tensor:
        """D-PACE's draft weights [B, N, D] (speculators' ``dpace_loss_decay``): q_j the draft's probability of the
        target's argmax at draft j, s_j = (1 - alpha) q_j + alpha (1 where draft j is not trained), P_k the product of
        s_1..s_k (the chance a greedy chain gets through draft k), w_k = sum_{j >= k} P_j over trained drafts, 0 where
        draft k is not trained."""
        anchors, trained = blocks.anchors, blocks.trained
        B, N = anchors.shape
        q = torch.zeros(B, N, len(trained), device=blocks.drafts.device)
        for j, ok in enumerate(trained):
            b, n = ok.nonzero(as_tuple=True)
            h = f.last_hidden_state[b, anchors[b, n] + j]  # the target's state before token a+j+1
            for part in torch.arange(len(b), device=q.device).split(self.chunk_tokens):
                logq = torch.log_softmax(project(blocks.drafts[b[part], n[part], j]).float(), -1)
                q[b[part], n[part], j] = logq.gather(1, self.lm_head(h[part]).argmax(-1, keepdim=True)).squeeze(1).exp()
        m = torch.stack(trained, dim=-1).float()
        s = torch.where(m > 0, (1 - self.dpace_alpha) * q + self.dpace_alpha, torch.ones_like(q))
        P = s.cumprod(-1)
        return (P * m).flip(-1).cumsum(-1).flip(-1) * m

    # -- checkpoint -----------------------------------------------------------------------------
    def export_state_dict(self, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The trained tensors under z-lab's names (the target's embedding and rotary tables are not saved)."""
        state = self.state_dict() if state is None else state
        return {k: v.detach().to("cpu").contiguous() for k, v in state.items()
                if not k.startswith(("embed_tokens.", "rotary_emb."))}

    def save_pretrained(self, directory: str | Path, dtype: torch.dtype = torch.bfloat16,
                        state_dict: dict[str, torch.Tensor] | None = None, layout: str | None = None,
                        verifier: dict | None = None) -> None:
        check_layout(self, layout)
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = state_dict if state_dict is not None else self.export_state_dict()
        save_file({k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()},
                  str(directory / "model.safetensors"), metadata={"format": "pt"})
        config = self.config.to_hf_dict()
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
        (directory / "config.json").write_text(json.dumps(config, indent=2))

    @classmethod
    def load(cls, directory: str | Path, target) -> "DFlashDraft":
        """A finished head for ``target`` (a Target or TargetMatrices), refused by name if it does not fit."""
        directory = Path(directory)
        if not (directory / "config.json").is_file() or not (directory / "model.safetensors").is_file():
            raise FileNotFoundError(f"{directory}: expected config.json and model.safetensors of a "
                                    f"{cls.config_class.variant} draft")
        config = cls.config_class.from_json(directory / "config.json")
        config.check_target(target.config)
        head = cls(config)
        tensors = load_file(str(directory / "model.safetensors"))
        expected = head.export_state_dict()
        missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
        wrong = sorted(k for k in set(expected) & set(tensors) if tensors[k].shape != expected[k].shape)
        if missing or unexpected or wrong:
            raise ValueError(f"{directory}: tensors do not match the {config.variant} layout of its config: missing {missing[:6]}, "
                             f"unexpected {unexpected[:6]}, wrong shape {wrong[:6]}")
        head.load_state_dict({k: v.to(expected[k].dtype) for k, v in tensors.items()}, strict=False)
        head.set_target(target)
        return head


def block_config(config_class: type[DFlashConfig], draft: DraftConfig, target, **own) -> DFlashConfig:
    """The draft's architecture: ``draft.config``'s file, or the recipe's options (``own``: a variant's fields) over
    the target's shape; refused by name where it does not fit the target or reads other layers than it captures."""
    options = draft.options
    if options.anchors < 1:
        raise ValueError(f"draft.anchors must be >= 1, got {options.anchors}")
    if draft.config:
        config = config_class.from_json(draft.config)
    else:
        config = config_class.from_target(target.config, options.block_size, options.num_layers, target.aux_layer_ids,
                                          options.mask_token_id, **own)
    config.check_target(target.config)
    if tuple(config.aux_layer_ids) != tuple(target.aux_layer_ids):
        raise ValueError(f"the draft config reads layers {list(config.aux_layer_ids)} but the target is set "
                         f"to capture {list(target.aux_layer_ids)}; set target.aux_layer_ids to match")
    return config


def build_dflash(draft: DraftConfig, target, token_counts: torch.Tensor | None = None) -> DFlashDraft:
    """A fresh DFlash head for ``target`` (the token counts are not used: it predicts the target's whole vocab)."""
    options = draft.options or DFlashOptions()
    config = block_config(DFlashConfig, dataclasses.replace(draft, options=options), target)
    head = DFlashDraft(config, anchors=options.anchors, decay_gamma=options.decay_gamma, weighting=options.weighting,
                       dpace_alpha=options.dpace_alpha)
    head.chunk_tokens, head.divergence = draft.loss_chunk_tokens, draft.loss
    head.set_target(target)
    return head
