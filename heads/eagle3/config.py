"""EAGLE-3's recipe fields (``Eagle3Options``) and architecture (``Eagle3Config``), read from and written as the
servers' flat-layout config.json; the speculators layout's config is mapped to the flat one (speculators.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from transformers import LlamaConfig

from headstart.heads.eagle3.speculators import ARCHITECTURES, flat_from_speculators, is_speculators, to_speculators_config
from headstart.models.head import DEFAULT_SPECULATIVE_TOKENS
from headstart.models.rope import rope_of, rope_original_max
from headstart.models.servable_layers import check_servable_ids
from headstart.models.target import default_aux_layer_ids, text_config


@dataclass(frozen=True)
class Eagle3Options:
    """An EAGLE-3 recipe's own ``draft:`` fields."""

    draft_vocab_size: int = 32000
    """Size of the draft vocab (the most frequent trained tokens); capped at the target vocab."""
    ttt_steps: int = 7
    """Training-time-test unroll length."""
    step_weight: float = 0.8
    """Loss weight of TTT step k is step_weight**k."""
    feature_noise: float = 0.0
    """Std of Gaussian noise added to the target's aux hidden states (the draft's input features) while training:
    the draft then learns to draft from features like its own imperfect ones (speculators trains with 0.05)."""
    fc_norm: bool = False
    """EAGLE-3.1: an RMSNorm on each target layer's feature before ``fc`` (vLLM's and speculators' ``fc_norm``)."""
    norm_output: bool = False
    """EAGLE-3.1: each step carries its final-normed state to the next (vLLM's and speculators' ``norm_output``)."""
    num_layers: int = 1
    """Decoder layers of the draft: the first reads cat(embeds, hidden), the others are plain Llama layers on its
    output (vLLM's and speculators' multi-layer EAGLE-3; SGLang builds one)."""


@dataclass(frozen=True)
class Eagle3Config:
    """The draft's architecture; serialised as the servers' flat-layout config.json."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target vocab V
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]  # vLLM ids (HF hidden_states index)
    target_num_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS
    """Tokens a server drafts per step unless told otherwise (speculators' ``speculative_tokens``)."""
    fc_norm: bool = False
    """EAGLE-3.1: one RMSNorm per target layer's feature before ``fc`` (tensors ``fc_norm.{i}.weight`` [H_t])."""
    norm_output: bool = False
    """EAGLE-3.1: the state carried from one step to the next is the final-normed one (no tensor of its own)."""
    num_hidden_layers: int = 1
    """Decoder layers: ``midlayer`` (the first, reading cat(embeds, hidden)), then plain Llama layers ``layers.{i}``,
    i = 1..n-1 (vLLM's names: it reads ``midlayer`` as ``layers.0``)."""

    speculators_type = "eagle3"
    """speculators' ``speculators_model_type`` and ``algorithm`` for this config (a head built on EAGLE-3's names its own)."""
    speculators_architectures = ARCHITECTURES
    """The architectures a speculators config of this type may name; the first is the one written."""

    @property
    def variant(self) -> str:
        """"EAGLE-3.1" with either of its norms on, else "EAGLE-3"."""
        return "EAGLE-3.1" if self.fc_norm or self.norm_output else "EAGLE-3"

    @classmethod
    def from_target(cls, target_config, draft_vocab_size: int = 32000, aux_layer_ids=None, fc_norm: bool = False,
                    norm_output: bool = False, num_layers: int = 1) -> "Eagle3Config":
        """Derive a draft config from any HF decoder config (hidden size, heads, rope, vocab); ``fc_norm`` and
        ``norm_output``: EAGLE-3.1's norms; ``num_layers``: the draft's decoder layers."""
        if num_layers < 1:
            raise ValueError(f"draft.num_layers must be >= 1, got {num_layers}")
        tc = text_config(target_config)
        n_layers = tc.num_hidden_layers
        ids = check_servable_ids(default_aux_layer_ids(n_layers) if aux_layer_ids is None else aux_layer_ids, n_layers)
        rope_theta, rope_scaling = rope_of(tc)
        heads = tc.num_attention_heads
        return cls(
            hidden_size=tc.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
            intermediate_size=tc.intermediate_size,
            vocab_size=tc.vocab_size,
            draft_vocab_size=min(draft_vocab_size, tc.vocab_size),
            target_hidden_size=tc.hidden_size,
            aux_layer_ids=ids,
            target_num_layers=n_layers,
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=tc.max_position_embeddings,
            fc_norm=fc_norm,
            norm_output=norm_output,
            num_hidden_layers=num_layers,
        )

    def to_hf_dict(self) -> dict:
        """config.json of the flat EAGLE-3 layout (SGLang; vLLM with method 'eagle3')."""
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "num_hidden_layers": self.num_hidden_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": False,
            "target_hidden_size": self.target_hidden_size,
            "norm_before_residual": False,
            # EAGLE-3.1's norms: vLLM's llama_eagle3 and SpecForge read these keys (false: EAGLE-3) (docs/FORMATS.md)
            "fc_norm": self.fc_norm,
            "norm_output": self.norm_output,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            # SGLang reads only this nested copy and captures id + 1 (docs/FORMATS.md).
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in self.aux_layer_ids],
                             "use_aux_hidden_state": True},
            "headstart": {"target_num_layers": self.target_num_layers, "speculative_tokens": self.speculative_tokens},
            "torch_dtype": "bfloat16",  # the export's dtype: save_pretrained writes the real one
        }

    @classmethod
    def from_hf_dict(cls, d: dict) -> "Eagle3Config":
        if d.get("architectures") != ["LlamaForCausalLMEagle3"]:
            raise ValueError(f"not a flat-layout EAGLE-3 config: architectures={d.get('architectures')}")
        missing = [k for k in ("hidden_size", "vocab_size", "draft_vocab_size", "eagle_aux_hidden_state_layer_ids")
                   if d.get(k) in (None, [])]
        if missing:
            raise ValueError(f"EAGLE-3 config.json lacks {missing} (or has them null / empty)")
        if d.get("norm_before_residual"):
            raise ValueError("EAGLE-3 config.json: norm_before_residual is true; headstart's head adds the un-normed "
                             "hidden state (SGLang implements only false)")
        if d.get("norm_before_fc") or (d.get("eagle_config") or {}).get("norm_before_fc"):
            raise ValueError("EAGLE-3 config.json: norm_before_fc is true (one norm over the concatenated features, "
                             "gpt-oss's variant); headstart's head has EAGLE-3.1's per-layer fc_norm instead")
        layers = d.get("num_hidden_layers", 1)
        if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
            raise ValueError(f"EAGLE-3 config.json: num_hidden_layers is {layers!r}, not a count of decoder layers")
        heads = d["num_attention_heads"]
        return cls(
            hidden_size=d["hidden_size"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            intermediate_size=d["intermediate_size"],
            vocab_size=d["vocab_size"],
            draft_vocab_size=d["draft_vocab_size"],
            target_hidden_size=d.get("target_hidden_size") or d["hidden_size"],
            aux_layer_ids=tuple(d["eagle_aux_hidden_state_layer_ids"]),
            target_num_layers=d.get("headstart", {}).get("target_num_layers", max(d["eagle_aux_hidden_state_layer_ids"]) + 1),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=d.get("rope_theta", 10000.0),
            rope_scaling=d.get("rope_scaling"),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            hidden_act=d.get("hidden_act", "silu"),
            speculative_tokens=d.get("headstart", {}).get("speculative_tokens", DEFAULT_SPECULATIVE_TOKENS),
            fc_norm=bool(d.get("fc_norm", False)),
            norm_output=bool(d.get("norm_output", False)),
            num_hidden_layers=layers,
        )

    def to_speculators_dict(self, verifier: dict | None) -> dict:
        """config.json of vLLM's speculators layout; ``verifier``: the target's fingerprint (docs/FORMATS.md B)."""
        return to_speculators_config(self.to_hf_dict(), verifier, self.speculators_type, self.speculators_architectures[0])

    @classmethod
    def flat_dict(cls, d: dict, where: str = "config.json") -> dict:
        """Either layout's config.json as the flat layout's (what ``from_hf_dict`` reads)."""
        if not is_speculators(d):
            return d
        return flat_from_speculators(d, where, cls.speculators_type, cls.speculators_architectures)

    @classmethod
    def from_json(cls, path: str | Path) -> "Eagle3Config":
        """Either layout's config.json (flat, or speculators: docs/FORMATS.md sections A and B)."""
        return cls.from_hf_dict(cls.flat_dict(json.loads(Path(path).read_text()), str(path)))

    def check_target(self, target_config) -> None:
        """Refuse, before any training, a draft config that does not fit the target."""
        tc = text_config(target_config)
        problems = []
        if self.target_hidden_size != tc.hidden_size:
            problems.append(f"target_hidden_size {self.target_hidden_size} != target hidden_size {tc.hidden_size}")
        if self.vocab_size != tc.vocab_size:
            problems.append(f"vocab_size {self.vocab_size} != target vocab_size {tc.vocab_size}")
        if self.hidden_size != tc.hidden_size:
            problems.append(f"hidden_size {self.hidden_size} != target hidden_size {tc.hidden_size} "
                            "(servers replace the draft's embedding with the target's, so they must match)")
        try:
            check_servable_ids(self.aux_layer_ids, tc.num_hidden_layers)
        except ValueError as err:
            problems.append(str(err))
        if problems:
            raise ValueError("the EAGLE-3 draft config does not fit the target:\n  " + "\n  ".join(problems))

    def llama_config(self) -> LlamaConfig:
        """A LlamaConfig for the HF building blocks (RMSNorm, MLP, rotary embedding)."""
        return LlamaConfig(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, hidden_act=self.hidden_act,
            rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
            max_position_embeddings=max(self.max_position_embeddings, rope_original_max(self.rope_scaling)),
            vocab_size=self.vocab_size,
        )
