"""The frozen target: any HF causal LM, returning the multi-layer hidden states a draft head reads.

Aux layer id ``k`` is the residual stream entering decoder layer ``k``, i.e. HF
``outputs.hidden_states[k]`` (index 0 = the embeddings) -- vLLM's convention; see
docs/FORMATS.md. It is captured with forward pre-hooks on the decoder layers, so the other L+1
hidden states are never kept. The forward runs the base model only: the next-token distribution
is computed on demand from ``last_hidden_state`` (``logits``/``argmax``), restricted to a vocab
subset or chunked, so no ``[B, T, V]`` float32 tensor is ever built.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class TargetConfig:
    """Which target to load and which of its layers feed the draft head."""

    path: str = ""
    """Local directory of an HF causal LM checkpoint (config.json + weights)."""
    aux_layer_ids: tuple[int, ...] | None = None
    """vLLM-convention layer ids (HF hidden_states index); None = (2, L//2, L-3)."""
    dtype: str = "bfloat16"
    """Weights dtype: bfloat16, float16 or float32."""
    device: str = "cpu"
    """Where the target runs; training overrides it with each rank's device."""
    attn_implementation: str | None = "sdpa"
    """HF attention implementation of the target (sdpa | eager | flash_attention_2 | ...)."""
    trust_remote_code: bool = False
    """Allow the checkpoint's own modeling code (HF ``trust_remote_code``)."""


@dataclass
class TargetOutput:
    aux_hidden_states: torch.Tensor | None  # [B, T, n*H], layers in ascending order (None when not asked for)
    last_hidden_state: torch.Tensor  # [B, T, H], after the final norm

    def select(self, index) -> "TargetOutput":
        """The states of the positions ``index`` (a slice, list or tensor over dim 1)."""
        aux = None if self.aux_hidden_states is None else self.aux_hidden_states[:, index]
        return TargetOutput(aux_hidden_states=aux, last_hidden_state=self.last_hidden_state[:, index])

    @staticmethod
    def cat(parts: list["TargetOutput"]) -> "TargetOutput":
        """The states of ``parts`` one after another along dim 1 (a copy, also of a single part)."""
        aux = None if parts[0].aux_hidden_states is None else torch.cat([p.aux_hidden_states for p in parts], dim=1)
        return TargetOutput(aux_hidden_states=aux, last_hidden_state=torch.cat([p.last_hidden_state for p in parts], dim=1))


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n, S] or per row [B, n, S] bool (True = may attend) -> the [1 or B, 1, n, S] additive mask HF attention takes."""
    allowed = allowed if allowed.dim() == 3 else allowed.unsqueeze(0)
    mask = torch.zeros(allowed.shape[0], 1, *allowed.shape[1:], dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed.unsqueeze(1), torch.finfo(dtype).min)


def text_config(config):
    """The decoder's config: a multimodal config's text part, else the config itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def cache_keyword(cls: type) -> str:
    """The keyword a transformers module's ``forward`` takes its KV cache by: ``cache`` in transformers 5.2x, where the
    old ``past_key_values`` warns that it is deprecated, and ``past_key_values`` before."""
    params = inspect.signature(cls.forward).parameters
    return next((name for name in ("cache", "past_key_values", "past_key_value") if name in params), "past_key_values")


def placeholder_token(target_config) -> int:
    """A token id for the positions a draft has not drafted yet (P-EAGLE's and DFlash's mask token): the target's pad
    token id, else its (first) eos token id, else 0."""
    tc = text_config(target_config)
    for key in ("pad_token_id", "eos_token_id"):
        value = getattr(tc, key, None)
        if value is None:
            value = getattr(target_config, key, None)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low / middle / high layers, in vLLM ids."""
    return (2, num_layers // 2, num_layers - 3)


def check_aux_layer_ids(layer_ids: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    ids = tuple(int(i) for i in layer_ids)
    if not ids:
        raise ValueError("aux_layer_ids is empty")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"aux layer ids {list(bad)} are out of range for a target with {num_layers} layers; "
            f"valid ids are 0..{num_layers - 1} (HF hidden_states index, 0 = embeddings)"
        )
    if list(ids) != sorted(set(ids)):
        raise ValueError(f"aux layer ids must be strictly increasing, got {list(ids)}")
    return ids


def context_length(config) -> int:
    """``max_position_embeddings`` of the (text) config; a config without one is refused by name rather
    than guessed, since a guess too small fails mid-generation and one too large wastes cache memory."""
    n = getattr(text_config(config), "max_position_embeddings", None)
    if not n:
        raise ValueError(f"{type(config).__name__} has no max_position_embeddings; pass the context length "
                         "explicitly (--max-len)")
    return int(n)


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    base = getattr(model, model.base_model_prefix, None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__}: cannot find its decoder layers at "
            f"'{model.base_model_prefix}.layers'; only decoder-only causal LMs are supported"
        )
    return layers


class Target(nn.Module):
    """A frozen causal LM that returns aux hidden states and its final hidden state."""

    def __init__(self, model: PreTrainedModel, aux_layer_ids: tuple[int, ...] | None = None,
                 capture_aux: bool = True) -> None:
        """``capture_aux=False``: no aux states at all (a draft model decoded as a ``Target``): its layers get no
        capture hooks, so wrapping one model many times costs nothing, and ``with_aux`` must stay False."""
        super().__init__()
        self.model = model
        self.model.eval().requires_grad_(False)
        self.layers = decoder_layers(model)
        self.base = getattr(model, model.base_model_prefix)
        self.cache_keyword = cache_keyword(type(self.base))  # read once: a compiled forward does not trace it
        n = len(self.layers)
        self.aux_layer_ids = () if not capture_aux else \
            check_aux_layer_ids(default_aux_layer_ids(n) if aux_layer_ids is None else aux_layer_ids, n)
        self._captured: dict[int, torch.Tensor] = {}
        for k in self.aux_layer_ids:
            self.layers[k].register_forward_pre_hook(self._capture_hook(k), with_kwargs=True)

    def _capture_hook(self, k: int):
        def hook(module, args, kwargs):
            self._captured[k] = args[0] if args else kwargs["hidden_states"]

        return hook

    @classmethod
    def from_pretrained(cls, config: TargetConfig) -> "Target":
        model = load_causal_lm(config)
        target = cls(model, config.aux_layer_ids)
        target.path = config.path
        return target

    path: str | None = None
    """The checkpoint directory the target was loaded from (None when built from a model in memory)."""

    def layer_state(self, index: int) -> dict[str, torch.Tensor]:
        """Decoder layer ``index``'s tensors (``TargetMatrices`` reads the same from the safetensors)."""
        return self.layers[index].state_dict()

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def context_length(self) -> int:
        """The longest sequence the target was built for (its config's ``max_position_embeddings``): the
        decoder's KV caches hold this many positions unless a tool is told fewer."""
        return context_length(self.model.config)

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V, H] (``TargetMatrices`` has the same attribute, read from the safetensors)."""
        return self.lm_head.weight

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        attention_mask: torch.Tensor | None = None,  # [B, T] 1 = real token, or a prepared 4D mask
        position_ids: torch.Tensor | None = None,
        past_key_values=None,  # an HF Cache the new tokens are written to (decoding), or None
        with_aux: bool = True,  # False: the head reads no aux states, so none are concatenated
    ) -> TargetOutput:
        self._captured.clear()
        out = self.base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        use_cache=past_key_values is not None, **{self.cache_keyword: past_key_values})
        with record_function("target: aux states"):  # a part of the step for torch.profiler
            if with_aux and not self.aux_layer_ids:
                raise ValueError("this Target captures no aux states (capture_aux=False); call it with with_aux=False")
            aux = torch.cat([self._captured[k] for k in self.aux_layer_ids], dim=-1) if with_aux else None  # [B, T, n*H]
        self._captured.clear()
        return TargetOutput(aux_hidden_states=aux, last_hidden_state=out.last_hidden_state)

    def first_layers(self, input_ids: torch.Tensor, layers: int, attention_mask, position_ids: torch.Tensor,
                     past_key_values=None) -> torch.Tensor:
        """The model's own forward cut after its first ``layers`` decoder layers -> their output [B, T, H] (no final
        norm)."""
        out: dict[str, torch.Tensor] = {}

        def keep(module, args, output):
            out["h"] = output[0] if isinstance(output, tuple) else output

        hook = decoder_layers(self.model)[layers - 1].register_forward_hook(keep)
        try:
            self._run_layers(slice(0, layers), input_ids, attention_mask, position_ids, past_key_values)
        finally:
            hook.remove()
        return out["h"]

    def layers_from(self, hidden: torch.Tensor, first: int, attention_mask, position_ids: torch.Tensor,
                    past_key_values=None) -> torch.Tensor:
        """The model's own forward from decoder layer ``first`` on, given the hidden state entering it [B, T, H] (what
        ``first_layers(..., first, ...)`` returned) -> the final hidden state, normed [B, T, H]. Self-speculation's
        verification: the first layers' K/V of the drafted tokens are already in the cache, and only the rest run."""
        def enter(module, args, kwargs):  # the layer reads ``hidden``, not what the (skipped) layers before made
            if args:
                return (hidden, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": hidden}

        hook = decoder_layers(self.model)[first].register_forward_pre_hook(enter, with_kwargs=True)
        dummy = torch.zeros(hidden.shape[:2], dtype=torch.long, device=hidden.device)  # embedded, then replaced
        try:
            return self._run_layers(slice(first, None), dummy, attention_mask, position_ids, past_key_values)
        finally:
            hook.remove()

    def skipping_layers(self, input_ids: torch.Tensor, skip: frozenset[int], attention_mask, position_ids: torch.Tensor,
                        past_key_values=None) -> torch.Tensor:
        """The model's own forward with the decoder layers ``skip`` left out (Draft & Verify's self-drafting) -> its
        final hidden state, normed [B, T, H]. The layers run write their K/V to their own cache layers."""
        return self._run_layers([i for i in range(self.num_layers) if i not in skip], input_ids, attention_mask,
                                position_ids, past_key_values)

    def _run_layers(self, which: slice | list[int], input_ids: torch.Tensor, attention_mask, position_ids: torch.Tensor,
                    past_key_values) -> torch.Tensor:
        """The base model's forward over the decoder layers ``which`` (a slice or their indices) only -> its last hidden
        state (final norm on). The cut is the config's layer count, which transformers' decoders loop over, and the
        layer list, both set for this call only; each layer keeps its ``layer_idx``, so its K/V go to its own cache
        layer."""
        text = self.model.config.get_text_config()
        full, base_layers = text.num_hidden_layers, self.base.layers
        kept = list(base_layers)[which] if isinstance(which, slice) else [base_layers[i] for i in which]
        try:
            text.num_hidden_layers = len(kept)
            self.base.layers = nn.ModuleList(kept)  # a decoder that loops over all of them
            return self.base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=past_key_values is not None,
                             **{self.cache_keyword: past_key_values}).last_hidden_state
        finally:
            text.num_hidden_layers = full
            self.base.layers = base_layers
            self._captured.clear()

    def vocab_head(self, vocab_ids: torch.Tensor | None = None):
        """A function [..., H] -> logits over ``vocab_ids`` [V'] (or the whole vocab).

        The rows of lm_head are sliced once here, not on every call."""
        cap = getattr(self.model.config.get_text_config(), "final_logit_softcapping", None)  # Gemma 2/3
        return vocab_head(self.lm_head.weight, self.lm_head.bias, cap, vocab_ids)

    def logits(self, last_hidden: torch.Tensor, vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The target's logits for ``last_hidden`` [..., H], over ``vocab_ids`` [V'] or the whole vocab."""
        return self.vocab_head(vocab_ids)(last_hidden)

    @torch.no_grad()
    def argmax(self, last_hidden: torch.Tensor, chunk_tokens: int | None = None) -> torch.Tensor:
        """Greedy next token [...] over the full vocab, ``chunk_tokens`` positions at a time."""
        return chunked_argmax(self.vocab_head(), last_hidden, self.vocab_size, chunk_tokens)


def vocab_head(weight: torch.Tensor, bias: torch.Tensor | None, softcap: float | None, vocab_ids: torch.Tensor | None = None):
    """[..., H] -> logits over ``vocab_ids`` (or all rows of ``weight``), softcapped when the model does
    (Gemma 2/3). Shared by the live target and the offline path, so both compute the same bits."""
    if vocab_ids is not None:
        weight = weight[vocab_ids]
        bias = None if bias is None else bias[vocab_ids]

    def head(hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, weight, bias)
        return logits if softcap is None else torch.tanh(logits / softcap) * softcap

    # A plain projection (no bias, no softcap) says so, so that a loss can fuse it (models/fused_loss.py).
    head.linear_weight = weight if bias is None and softcap is None else None
    return head


ARGMAX_CHUNK_ENTRIES = 2**26
"""Logit entries (positions x V) one chunk of a full-vocab argmax holds: 256 MiB of float32 -- 1,365 positions
at SmolLM2's 49k vocab, 256 at Gemma 3's 262k (a fixed 1,024 positions held 1 GiB there)."""


@torch.no_grad()
def chunked_argmax(full_head, last_hidden: torch.Tensor, vocab_size: int, chunk_tokens: int | None = None) -> torch.Tensor:
    """Argmax over the full vocab [...], ``chunk_tokens`` positions at a time (default: as many as fit
    ``ARGMAX_CHUNK_ENTRIES``), so no [N, V] exists at once."""
    chunk_tokens = chunk_tokens or max(1, ARGMAX_CHUNK_ENTRIES // vocab_size)
    flat = last_hidden.reshape(-1, last_hidden.shape[-1])  # [N, H]
    ids = torch.cat([full_head(c).argmax(-1) for c in flat.split(chunk_tokens)])
    return ids.view(last_hidden.shape[:-1])


def dtype_of(name: str) -> torch.dtype:
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
             "float32": torch.float32, "fp32": torch.float32}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; use one of bfloat16, float16, float32")
    return table[name]


def load_causal_lm(config: TargetConfig) -> PreTrainedModel:
    """Load a local HF causal LM, frozen and in eval mode; never reaches a model hub."""
    path = Path(config.path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no HF checkpoint at {config.path!r}: config.json not found (only local paths are loaded)")
    hf_config = AutoConfig.from_pretrained(path, trust_remote_code=config.trust_remote_code, local_files_only=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=dtype_of(config.dtype),
            attn_implementation=config.attn_implementation,
            trust_remote_code=config.trust_remote_code,
            local_files_only=True,
        )
    except ValueError as err:
        if "Unrecognized configuration class" in str(err):
            archs = json.loads((path / "config.json").read_text()).get("architectures")
            raise ValueError(
                f"{config.path!r} holds a {hf_config.model_type!r} model ({archs}), not a causal LM "
                "that AutoModelForCausalLM can load"
            ) from err
        raise
    return model.to(config.device).eval().requires_grad_(False)


def load_tokenizer(path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    if not Path(path).is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {path!r} (only local paths are loaded)")
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
