"""EAGLE-3 draft head, in exactly the layout vLLM and SGLang load (docs/FORMATS.md section A).

    h_0      = fc(cat(aux hidden states))                      # [B, T, H] from [B, T, 3*H_t]
    step k:  x = cat(input_layernorm(embed(token_{t+1+k})), hidden_norm(h_k))    # [B, T, 2H]
             a = h_k + o_proj(attn(q/k/v_proj(x)))             # residual = the un-normed hidden
             h_{k+1} = a + mlp(post_attention_layernorm(a))
             logits_k = lm_head(norm(h_{k+1}))                 # over the draft vocab, predicts token t+2+k

EAGLE-3.1 (``Eagle3Config.fc_norm`` / ``norm_output``, as vLLM and speculators define them): ``fc_norm`` puts one
RMSNorm on each target layer's feature before ``fc`` (h_0 = fc(cat(fc_norm_i(f_i)))); ``norm_output`` carries the
final-normed state norm(h_{k+1}) to the next step instead of h_{k+1} (the logits are lm_head(norm(h_{k+1})) either way).

Training-time test (TTT) unrolls K steps. A query at position t in step k attends to the step-0 keys
at positions <= t (causal) plus, in each step 1..k, only the key at its own position t; rotary
position of step k is t + k, which is what the drafter sees at inference (one more per draft step).
The diagonal keys are computed as per-position dot products, so the score matrix stays [T, T + k]
instead of the [T, (k+1)T] block mask.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.profiler import record_function
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from headstart.models.draft_vocab import build_draft_vocab, check_draft_vocab
from headstart.models.ttt_attention import ttt_attention, ttt_attention_at
from headstart.models.vocab_loss import VocabProjection, chunked_vocab_loss
from headstart.models.head import (
    DraftConfig,
    FeatureNeeds,
    Features,
    StepTally,
    check_layout,
    layer_activation_bytes,
    loss_chunk_bytes,
    loss_denominator,
    shift_left,
)
from headstart.heads.eagle3.config import Eagle3Config, Eagle3Options
from headstart.heads.eagle3.speculators import from_speculators_tensors, is_speculators, to_speculators_tensors


RECOMPUTE_ABOVE = 2**24
"""Logit entries (positions x V_d) of one TTT step above which its loss is recomputed in backward instead of
kept: 64 MiB of float32 per step. Below it (T = 256 at V_d = 32k) keeping them is faster and small."""


class Eagle3Attention(nn.Module):
    """Attention whose q/k/v read the 2H input cat(embeds, hidden) (``inputs`` = 2; a later layer's read H: 1)."""

    def __init__(self, config: Eagle3Config, inputs: int = 2) -> None:
        super().__init__()
        h, nh, nkv, hd = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, hd
        self.q_proj = nn.Linear(inputs * h, nh * hd, bias=False)
        self.k_proj = nn.Linear(inputs * h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(inputs * h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.block = 512  # query rows per checkpointed block of the TTT attention

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, 2H] -> q [B, nh, T, hd], k and v [B, nh, T, hd] (kv heads repeated for GQA)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        rep = self.num_heads // self.num_kv_heads
        return q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)



class Eagle3DecoderLayer(nn.Module):
    """``midlayer``: one Llama decoder layer whose attention reads cat(embeds, hidden)."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        lc = config.llama_config()
        self.self_attn = Eagle3Attention(config)
        self.mlp = LlamaMLP(lc)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def attn_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2H], embeds first

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        h = hidden + attn_out  # residual = the un-normed hidden (norm_before_residual = false)
        return h + self.mlp(self.post_attention_layernorm(h))


class LaterLayer(nn.Module):
    """A multi-layer draft's layer i >= 1: a plain pre-norm Llama decoder layer (HF's tensor names) on the layer
    before's output, its attention through the same ``attend`` as the first layer's (vLLM's later layers)."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.self_attn = Eagle3Attention(config, inputs=1)
        self.mlp = LlamaMLP(config.llama_config())
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def attn_input(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.input_layernorm(hidden)

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The attention's heads [B, nh, n, hd] -> the layer's output: o_proj, residual, MLP, residual."""
        B, nh, n, hd = attn_out.shape
        h = hidden + self.self_attn.o_proj(attn_out.transpose(1, 2).reshape(B, n, nh * hd))
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        # the parts around the attention are what train.compile compiles (Eagle3Draft.compiled); attend stays eager
        return self.finish(hidden, attend(*self.self_attn.qkv(self.attn_input(hidden), cos, sin)))


def run_positions(valid_steps: list[torch.Tensor]) -> torch.Tensor:
    """Where TTT steps 1..K-1 run, [K-1, B, T] bool, from where each step is trained (``valid_steps``: K [B, T]):
    step k wherever it or a later step is trained -- a later step at t reads step k's output and keys at t -- so each
    step runs among the positions of the step before it."""
    later = torch.stack(valid_steps[1:]).flip(0).cumsum(0).flip(0) > 0  # step k: any of steps k..K-1
    if not later[-1].any():  # the sets are nested: an empty step is the last one (and any before it)
        # Never an empty step: ZeRO-3 gathers and reduces each module's weights collectively, and a rank that ran
        # the layer on zero positions fell out of step with the others (gloo: size mismatch). One unread position
        # in every step keeps every rank's calls and gradients alike (and the sets nested); it is never trained on.
        later[:, 0, 0] = True
    return later


class Eagle3Draft(nn.Module):
    """The EAGLE-3 head. ``embed_tokens`` is the target's, frozen, and not saved when H == H_t."""

    config_class = Eagle3Config
    """What reads and writes its config.json (a head built on this one names its own)."""
    needs = FeatureNeeds(aux_hidden_states=True, draft_vocab_logits=True)
    layouts = ("flat", "speculators")  # docs/FORMATS.md sections A and B; the first is the default
    compiled = ("midlayer.attn_input", "midlayer.self_attn.qkv", "midlayer.finish", "layers.*.attn_input",
                "layers.*.self_attn.qkv", "layers.*.finish", "norm")
    """What ``train.compile`` compiles (models/train_compile.py): each layer of the draft step around its attention,
    the final norm."""
    skip_untrained = True
    """The loss runs each TTT step 1.. only where it or a later step is trained (``run_positions``); False
    runs them everywhere (the same loss and gradients, more work: tests/test_eagle3.py holds them equal)."""

    def __init__(self, config: Eagle3Config, ttt_steps: int = 7, step_weight: float = 0.8) -> None:
        super().__init__()
        self.config = config
        self.ttt_steps = ttt_steps
        self.chunk_tokens = 1024  # trained positions per [chunk, V_d] logits block of the loss
        self.divergence = "kl"  # DraftConfig.loss (models/vocab_loss.py divergence_sum)
        self.feature_noise = 0.0  # Eagle3Options.feature_noise
        self.step_weight = step_weight
        n_aux = len(config.aux_layer_ids)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(n_aux * config.target_hidden_size, config.hidden_size, bias=False)
        if config.fc_norm:  # EAGLE-3.1: one norm per target layer's feature, before fc
            self.fc_norm = nn.ModuleList(LlamaRMSNorm(config.target_hidden_size, eps=config.rms_norm_eps)
                                         for _ in range(n_aux))
        self.midlayer = Eagle3DecoderLayer(config)
        if config.num_hidden_layers > 1:  # named layers.{i}, i >= 1: vLLM reads midlayer as layers.0
            self.layers = nn.ModuleDict({str(i): LaterLayer(config) for i in range(1, config.num_hidden_layers)})
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config.llama_config())
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    def activation_bytes(self, tokens: int, sequences: int, element_bytes: int) -> dict[str, int]:
        """headstart plan: every TTT step runs the decoder layer over the step's tokens (all of them, the upper
        bound: steps 1.. skip untrained positions; ``steps_run``'s expected share where a head samples them), and a
        multi-layer draft's later layers each as a plain layer; the attention runs in blocks of 512 query rows (one block
        of scores live at a time; packed batches on a GPU too). The first layer reads a 2H-wide input pair (embedding,
        hidden) through two norms into q/k/v: 8H a token more than a plain layer, a constant fitted to
        benchmarks/bench_memory.py's measured steps (hidden 1024, 7 steps, 1k-32k tokens, CPU float32 and H200
        bf16: the estimate is 0.8-1.1x the measured peak)."""
        c = self.config
        per_step = layer_activation_bytes(tokens, c.hidden_size, c.intermediate_size, element_bytes)
        per_step += tokens * 8 * c.hidden_size * element_bytes
        per_step += (c.num_hidden_layers - 1) * layer_activation_bytes(tokens, c.hidden_size, c.intermediate_size,
                                                                        element_bytes)  # a multi-layer draft's later
        fc = tokens * c.hidden_size * element_bytes
        scores = min(512, tokens) * tokens * c.num_attention_heads * 4 * 2
        if tokens * c.draft_vocab_size <= RECOMPUTE_ABOVE:  # small steps keep their logits for backward (see there)
            loss = {"loss: kept logits, every step": self.ttt_steps * tokens * c.draft_vocab_size * 4 * 2}
        else:
            loss = {"loss chunks": loss_chunk_bytes(self.chunk_tokens, c.draft_vocab_size, tokens)}
        run = self.steps_run()
        label = f"{self.ttt_steps} TTT steps" + ("" if run == self.ttt_steps else f", {run:.2f} steps' worth of positions")
        return {f"head activations ({label})": int(run * per_step) + fc,
                "attention scores, one block of 512 query rows": scores, **loss}

    def steps_run(self) -> float:
        """The TTT steps' positions while training, in steps' worth of a sequence (plan's bound: every step at every
        position; a head that trains its later steps on a share of them counts the shares)."""
        return float(self.ttt_steps)

    # -- draft vocab ---------------------------------------------------------------------------
    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.numel() != self.config.draft_vocab_size or t2d.numel() != self.config.vocab_size:
            raise ValueError(f"draft vocab of {d2t.numel()} / {t2d.numel()} does not match the config "
                             f"({self.config.draft_vocab_size} / {self.config.vocab_size})")
        check_draft_vocab(d2t, t2d)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def target_vocab_ids(self) -> torch.Tensor:
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t  # [V_d]

    def load_target_embeddings(self, weight: torch.Tensor) -> None:
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight.to(self.embed_tokens.weight.dtype))

    # -- training -------------------------------------------------------------------------------
    def forward(self, features: Features) -> tuple[torch.Tensor, dict[str, float]]:
        # Training goes through forward so FSDP2 / ZeRO-3 hooks gather the parameters.
        return self.loss(features)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's aux hidden states [B, T, n * H_t] -> the first step's hidden [B, T, H]: ``fc``, after each
        layer's own norm with ``fc_norm`` (EAGLE-3.1)."""
        if self.config.fc_norm:
            aux = torch.cat([norm(f) for norm, f in zip(self.fc_norm, aux.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return self.fc(aux)

    def readout(self, hidden: torch.Tensor) -> torch.Tensor:
        """What ``lm_head`` reads from a step's state: its final norm, or the state itself where the step already
        carries the normed one (``norm_output``, EAGLE-3.1)."""
        return hidden if self.config.norm_output else self.norm(hidden)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """A step's state [..., H] -> draft-vocab logits [..., V_d] in the head's dtype (what the drafters read)."""
        return self.lm_head(self.readout(hidden))

    def step(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             attend: Callable[..., torch.Tensor]) -> torch.Tensor:
        """One draft step, the one both training and decoding run: the pairs (hidden [B, n, H], token [B, n]) at
        rotary ``positions`` [B, n] -> the step's state [B, n, H] (what ``logits`` reads, and the next step's hidden):
        the last layer's output, or its final norm with ``norm_output``. Only ``attend(q, k, v, layer)`` -> [B, nh,
        n, hd] differs: the TTT pattern over the unrolled steps' keys of that layer in training (``unroll_hidden``),
        the drafter's KV cache of that layer when decoding (heads/eagle3/drafter.py)."""
        with record_function("head: draft step"):  # a part of the step for torch.profiler
            cos, sin = self.rotary_emb(hidden, positions)
            x = self.midlayer.attn_input(self.embed_tokens(tokens).to(hidden.dtype), hidden)
            out = attend(*self.midlayer.self_attn.qkv(x, cos, sin), 0)  # [B, nh, n, hd]
            B, nh, n, hd = out.shape
            out = self.midlayer.finish(hidden, self.midlayer.self_attn.o_proj(out.transpose(1, 2).reshape(B, n, nh * hd)))
            for i, layer in enumerate(self.later_layers(), start=1):
                out = layer(out, cos, sin, lambda q, k, v, i=i: attend(q, k, v, i))
            return self.norm(out) if self.config.norm_output else out

    def later_layers(self) -> list[LaterLayer]:
        """Layers 1..n-1 of a multi-layer draft, in order (none for EAGLE-3's one layer)."""
        return [self.layers[str(i)] for i in range(1, self.config.num_hidden_layers)]

    def step_input(self, k: int, hidden: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """TTT step k's input pairs from the previous step's state [B, n, H] and the data's tokens t+1+k [B, n]:
        EAGLE-3 feeds both back as they are (a head that drafts from other inputs overrides this)."""
        return hidden, tokens

    def unroll_hidden(self, f: Features, needed: torch.Tensor | None = None):
        """Yield the TTT steps' hidden outputs [B, T, H] (what ``logits`` reads): step k at position t reads token
        t+1+k at rotary position t+k, attending causally to step 0's keys and to its own position in steps 1..k
        (memory linear in T: models/ttt_attention.py).

        ``needed`` [K-1, B, T] bool: where steps 1.. run, step k at ``needed[k-1]``, each step's positions among the
        step before's (``run_positions``). Their outputs elsewhere are zeros: a later step at t reads only step 0's
        keys and its own position's earlier steps, so those positions come out exactly as in the full unroll, at the
        cost of the trained share of the sequence. Step 0 always runs everywhere: its keys are every later query's
        context."""
        aux = f.aux_hidden_states.to(self.fc.weight.dtype)
        if self.training and self.feature_noise > 0:
            aux = aux + torch.randn_like(aux) * self.feature_noise
        hidden = self.project(aux)  # [B, T, H]
        base_pos, documents = f.positions(), f.documents()  # a packed batch: each document from position 0
        n_layers = self.config.num_hidden_layers
        keys, values = [[] for _ in range(n_layers)], [[] for _ in range(n_layers)]  # by layer, then by step
        block = self.midlayer.self_attn.block

        def ttt(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int) -> torch.Tensor:
            keys[layer].append(key)
            values[layer].append(value)
            return ttt_attention(q, keys[layer], values[layer], block, documents=documents)

        if needed is None:
            for k in range(self.ttt_steps):
                hidden = self.step(*self.step_input(k, hidden, shift_left(f.input_ids, 1 + k, 0)), base_pos + k, ttt)
                yield hidden
            return
        hidden = self.step(hidden, shift_left(f.input_ids, 1, 0), base_pos, ttt)
        yield hidden
        B, T, H = hidden.shape
        b, t = needed[0].nonzero(as_tuple=True)  # row-major, as ttt_attention_at expects
        at_keys, at_values = [[] for _ in range(n_layers)], [[] for _ in range(n_layers)]  # steps 1.. at (b, t)

        def ttt_at(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int) -> torch.Tensor:
            at_keys[layer].append(key)
            at_values[layer].append(value)
            return ttt_attention_at(q, b, t, keys[layer][0], values[layer][0], at_keys[layer], at_values[layer], block,
                                    documents=documents)

        h = hidden[b, t].unsqueeze(0)  # [1, N, H]
        for k in range(1, self.ttt_steps):
            keep = needed[k - 1][b, t]  # of the previous step's positions, this step's (a subset: see run_positions)
            if not keep.all():
                b, t, h = b[keep], t[keep], h[:, keep]
                for layer in range(n_layers):
                    at_keys[layer][:] = [x[:, :, keep] for x in at_keys[layer]]
                    at_values[layer][:] = [x[:, :, keep] for x in at_values[layer]]
            h = self.step(*self.step_input(k, h, shift_left(f.input_ids, 1 + k, 0)[b, t].unsqueeze(0)),
                          (base_pos + k)[b, t].unsqueeze(0), ttt_at)
            yield hidden.new_zeros(B, T, H).index_put((b, t), h[0])

    def trained_positions(self, valid_steps: list[torch.Tensor]) -> list[torch.Tensor]:
        """Where each TTT step is trained, from where it can be ([B, T] bool a step: a target token in the draft
        vocab, in the same document): all of them (a head that trains its later steps on fewer overrides this)."""
        return valid_steps

    def unroll(self, f: Features):
        """Yield the TTT steps' draft logits [B, T, V_d] (float32), step k at position t predicting
        token t+2+k from token t+1+k and the previous step's hidden output."""
        for hidden in self.unroll_hidden(f):
            yield self.logits(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.draft_logits(hidden).float()

    def loss(self, f: Features) -> tuple[torch.Tensor, dict[str, float]]:
        """Unrolled TTT loss: forward KL to the target on the draft vocab, step weights w^k, summed over
        positions and divided by ``loss_denominator`` (the per-step means are metrics)."""
        # The target's distribution at position j predicts token j+1; it is trained where that
        # token is an assistant token and the target's argmax lies in the draft vocab.
        valid = torch.zeros_like(f.loss_mask, dtype=torch.bool)
        valid[:, :-1] = f.loss_mask[:, 1:].bool() & f.target_in_draft[:, :-1]
        denominator = loss_denominator(f)
        B, T, V_d = f.target_logits.shape
        target_rows = f.target_logits.reshape(B * T, V_d)
        total = torch.zeros((), dtype=torch.float32, device=f.input_ids.device)
        tally = StepTally()
        # Step k trains position t on the target's distribution at t+1+k (token t+2+k, in t's document).
        valid_steps = self.trained_positions([f.within_document(shift_left(valid, 1 + k, False), 2 + k)
                                              for k in range(self.ttt_steps)])
        needed = run_positions(valid_steps) if self.ttt_steps > 1 and self.skip_untrained else None
        for k, hidden in enumerate(self.unroll_hidden(f, needed)):  # hidden [B, T, H]
            valid_k = valid_steps[k]
            b, t = valid_k.nonzero(as_tuple=True)  # the trained positions; their target is at t+1+k
            # Only the trained positions' logits, a chunk at a time, recomputed in backward: no [B, T, V_d]
            # float32 tensor is kept per step (target restricted to the draft vocab, renormalised).
            step_sum, correct, top5, accept = chunked_vocab_loss(
                VocabProjection(self.readout, self.lm_head.weight), hidden[b, t], lambda rows: target_rows[rows], b * T + t + 1 + k, torch.zeros_like(b),
                soft=True, chunk_tokens=self.chunk_tokens, recompute=len(b) * V_d > RECOMPUTE_ABOVE,
                divergence=self.divergence, full_metrics=f.full_metrics)
            total = total + (self.step_weight**k) * step_sum / denominator
            tally.add(valid_k, b, t, step_sum, correct, top5=top5, accept=accept)
        return total, tally.metrics(valid)

    # -- checkpoint -----------------------------------------------------------------------------
    def export_state_dict(self, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Tensors under the names servers load (flat layout); embed_tokens only when H != H_t.

        ``state`` is a full (gathered) state dict when the head is sharded; default: this module's."""
        skip = {"embed_tokens.weight"} if self.config.hidden_size == self.config.target_hidden_size else set()
        out = {}
        for name, tensor in (self.state_dict() if state is None else state).items():
            if name in skip:
                continue
            out[name] = tensor.detach().to("cpu").contiguous()
        return out

    def save_pretrained(self, directory: str | Path, dtype: torch.dtype = torch.bfloat16,
                        state_dict: dict[str, torch.Tensor] | None = None, layout: str | None = None,
                        verifier: dict | None = None) -> None:
        """Write config.json + model.safetensors in the flat server layout or vLLM's speculators layout
        (``verifier``: the target's ``provenance.fingerprint``, named in the speculators config)."""
        layout = check_layout(self, layout)
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = state_dict if state_dict is not None else self.export_state_dict()
        tensors = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}
        config = self.config.to_hf_dict()
        if layout == "speculators":
            tensors, config = to_speculators_tensors(tensors), self.config.to_speculators_dict(verifier)
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        (directory / "config.json").write_text(json.dumps(config, indent=2))

    @classmethod
    def from_pretrained(cls, directory: str | Path, target_embeddings: torch.Tensor | None = None, **kwargs) -> "Eagle3Draft":
        directory = Path(directory)
        if not (directory / "config.json").is_file() or not (directory / "model.safetensors").is_file():
            raise FileNotFoundError(f"{directory}: expected config.json and model.safetensors of an EAGLE-3 draft")
        config = cls.config_class.from_json(directory / "config.json")
        model = cls(config, **kwargs)
        tensors = load_file(str(directory / "model.safetensors"))
        if is_speculators(json.loads((directory / "config.json").read_text())):
            tensors = from_speculators_tensors(tensors)  # layers.0.* -> midlayer.*; a flat head keeps its names
        if target_embeddings is not None and tuple(target_embeddings.shape) != (config.vocab_size, config.hidden_size):
            raise ValueError(f"{directory} was trained for a target with vocab {config.vocab_size} and hidden size "
                             f"{config.hidden_size}, but the given target embeddings are {tuple(target_embeddings.shape)}")
        if "embed_tokens.weight" not in tensors:
            if target_embeddings is None:
                raise ValueError(f"{directory} has no embed_tokens (H == H_t): pass the target's embeddings")
            tensors["embed_tokens.weight"] = target_embeddings
        missing, unexpected = model.load_state_dict(
            {k: v.to(model.fc.weight.dtype) if v.is_floating_point() else v for k, v in tensors.items()}, strict=False
        )
        if missing or unexpected:
            raise ValueError(f"{directory}: tensors do not match the {config.variant} layout: missing {missing}, "
                             f"unexpected {unexpected}")
        check_draft_vocab(model.d2t, model.t2d)
        return model


    @classmethod
    def load(cls, directory: str | Path, target) -> "Eagle3Draft":
        """A finished head for ``target`` (a Target or TargetMatrices), refused by name if it does not fit."""
        head = cls.from_pretrained(directory, target_embeddings=target.embed_tokens.weight)
        head.config.check_target(target.config)
        return head


def build_eagle3(draft: DraftConfig, target, token_counts: torch.Tensor) -> Eagle3Draft:
    """A fresh EAGLE-3 head for ``target`` (a Target): its draft vocab from the loss-masked token counts [V]."""
    options = draft.options or Eagle3Options()
    if draft.config:
        config = Eagle3Config.from_json(draft.config)
        wrong = [k for k in ("fc_norm", "norm_output") if getattr(options, k) and not getattr(config, k)]
        if wrong:
            raise ValueError(f"draft.{', draft.'.join(wrong)} is true but draft.config ({draft.config}) sets it false: "
                             "set it in the config file, or drop draft.config")
        check_layers(options.num_layers, config, draft.config)
    else:
        config = Eagle3Config.from_target(target.config, options.draft_vocab_size, target.aux_layer_ids,
                                          fc_norm=options.fc_norm, norm_output=options.norm_output,
                                          num_layers=options.num_layers)
    head = Eagle3Draft(config, ttt_steps=options.ttt_steps, step_weight=options.step_weight)
    return fit_to_target(head, draft, target, token_counts, options.feature_noise)


def check_layers(num_layers: int, config: Eagle3Config, where: str) -> None:
    """Refuse a recipe's ``draft.num_layers`` that its ``draft.config`` file contradicts (1, the default, defers)."""
    if num_layers != 1 and num_layers != config.num_hidden_layers:
        raise ValueError(f"draft.num_layers is {num_layers} but draft.config ({where}) has num_hidden_layers "
                         f"{config.num_hidden_layers}: set it in the config file, or drop draft.config")


def fit_to_target(head: Eagle3Draft, draft: DraftConfig, target, token_counts: torch.Tensor,
                  feature_noise: float) -> Eagle3Draft:
    """A freshly built head (EAGLE-3's or one built on it) checked against ``target`` and given what it reads of it:
    the loss settings of ``draft``, its draft vocab from the loss-masked token counts [V], the target's embeddings."""
    config = head.config
    config.check_target(target.config)
    if tuple(config.aux_layer_ids) != tuple(target.aux_layer_ids):
        raise ValueError(f"the draft config reads layers {list(config.aux_layer_ids)} but the target is set "
                         f"to capture {list(target.aux_layer_ids)}; set target.aux_layer_ids to match")
    head.chunk_tokens = draft.loss_chunk_tokens
    head.divergence = draft.loss
    head.feature_noise = feature_noise
    head.set_draft_vocab(*build_draft_vocab(token_counts, config.draft_vocab_size))
    head.load_target_embeddings(target.embed_tokens.weight)
    return head

