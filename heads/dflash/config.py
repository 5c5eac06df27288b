"""DFlash's recipe fields (``DFlashOptions``) and architecture (``DFlashConfig``), serialised as the z-lab layout's
config.json that vLLM and SGLang load (docs/FORMATS.md section H)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from transformers import Qwen3Config

from headstart.models.rope import rope_of, rope_original_max
from headstart.models.servable_layers import check_servable_ids
from headstart.models.target import default_aux_layer_ids, placeholder_token, text_config

ARCHITECTURE = "DFlashDraftModel"


@dataclass(frozen=True)
class DFlashOptions:
    """A DFlash recipe's own ``draft:`` fields."""

    block_size: int = 16
    """B: the block one draft forward fills -- the bonus token and B-1 masked positions, i.e. up to B-1 drafts."""
    num_layers: int = 1
    """Draft decoder layers (Qwen3-style; the published 8B heads have 5)."""
    anchors: int = 64
    """Blocks trained per sequence and step: anchors drawn at random among the positions whose next token is trained
    (speculators' ``max_anchors``, 512 by default at 8B's sequence lengths)."""
    weighting: str = "dpace"
    """How the block's slots are weighted in the loss: ``dpace`` (D-PACE, arXiv 2605.18810, speculators' default) --
    slot k by the expected number of accepted slots from k on, from the draft's own probability q_j of the target's
    token: s_j = (1 - alpha) q_j + alpha, P_k = prod_{j<=k} s_j, w_k = sum_{j>=k} P_j -- or ``decay``: slot k (k >= 1)
    by exp(-(k-1)/gamma), early slots most (speculators' fixed-exp-decay). On the demo target's quick-start budget
    D-PACE gave tau 1.178 against the decay's 1.134 (benchmarks/results/dflash_vs_eagle3_demo_quick.json)."""
    decay_gamma: float = 4.0
    """``decay``'s gamma (0 weighs the slots alike)."""
    dpace_alpha: float = 0.5
    """``dpace``'s alpha in (0, 1]: 1 weighs slot k by the number of slots from k on, lower by the draft's chances."""
    mask_token_id: int | None = None
    """The masked positions' token; None: the target's pad token, else its eos token (its embedding is the target's)."""


@dataclass(frozen=True)
class DFlashConfig:
    """The draft's architecture; serialised as the z-lab ``DFlashDraftModel`` config.json."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]
    """The target layers read, as headstart's (and vLLM's capture) ids: id k = the input of layer k. z-lab's
    ``target_layer_ids`` count layer outputs: k - 1."""
    target_num_layers: int
    block_size: int
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"

    variant = "DFlash"
    architecture = ARCHITECTURE
    """config.json's ``architectures[0]``: what the servers pick their model class by."""

    @classmethod
    def from_target(cls, target_config, block_size: int = 16, num_layers: int = 1, aux_layer_ids=None,
                    mask_token_id: int | None = None, **own) -> "DFlashConfig":
        """Over the target's shape; ``own``: a variant's own fields (set at construction, so that its checks see
        them and not its defaults)."""
        tc = text_config(target_config)
        n = tc.num_hidden_layers
        ids = check_servable_ids(default_aux_layer_ids(n) if aux_layer_ids is None else aux_layer_ids, n)
        theta, scaling = rope_of(tc)
        heads = tc.num_attention_heads
        return cls(hidden_size=tc.hidden_size, num_hidden_layers=num_layers, num_attention_heads=heads,
                   num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
                   head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
                   intermediate_size=tc.intermediate_size, vocab_size=tc.vocab_size, target_hidden_size=tc.hidden_size,
                   aux_layer_ids=ids, target_num_layers=n, block_size=block_size,
                   mask_token_id=placeholder_token(target_config) if mask_token_id is None else int(mask_token_id),
                   rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
                   max_position_embeddings=tc.max_position_embeddings, **own)

    def to_hf_dict(self) -> dict:
        """config.json of z-lab's layout: vLLM (``method: dflash``) and SGLang (``DFLASH``) read it as it is."""
        return {
            "architectures": [self.architecture],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
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
            "tie_word_embeddings": False,
            "attention_bias": False,
            # full attention: bidirectional inside the block (vLLM and SGLang read a non-causal layer from this)
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "block_size": self.block_size,
            "num_target_layers": self.target_num_layers,
            "dflash_config": {"mask_token_id": self.mask_token_id,
                              "target_layer_ids": [i - 1 for i in self.aux_layer_ids]},  # layer outputs (z-lab)
            "headstart": {"target_hidden_size": self.target_hidden_size},
            "torch_dtype": "bfloat16",
        } | ({"dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": [i - 1 for i in self.aux_layer_ids],
                                **self.own(), "block_size": self.block_size}} if self.own() else {})

    @classmethod
    def from_hf_dict(cls, d: dict, where: str = "config.json") -> "DFlashConfig":
        if d.get("architectures") != [cls.architecture]:
            raise ValueError(f"{where}: not a {cls.variant} config: architectures={d.get('architectures')}")
        dflash = d.get("dflash_config") or {}
        block = dflash.get("block_size", d.get("block_size"))
        problems = [f"{key} is missing" for key, value in (("block_size", block), ("dflash_config.mask_token_id",
                    dflash.get("mask_token_id")), ("dflash_config.target_layer_ids", dflash.get("target_layer_ids")),
                    ("num_target_layers", d.get("num_target_layers"))) if value in (None, [])]
        types = d.get("layer_types") or []
        if any(t != "full_attention" for t in types):
            problems.append(f"layer_types {types}: headstart's DFlash layers attend bidirectionally inside the block "
                            "(full_attention); sliding or causal layers are not implemented")
        if dflash.get("causal") or d.get("is_causal"):
            problems.append("causal is true: headstart's DFlash layers attend bidirectionally inside the block")
        if problems:
            raise ValueError(f"{where}: cannot read this {cls.variant} config:\n  " + "\n  ".join(problems))
        heads = d["num_attention_heads"]
        theta, scaling = float(d.get("rope_theta", 10000.0)), d.get("rope_scaling")
        return cls(hidden_size=d["hidden_size"], num_hidden_layers=d["num_hidden_layers"], num_attention_heads=heads,
                   num_key_value_heads=d.get("num_key_value_heads") or heads,
                   head_dim=d.get("head_dim") or d["hidden_size"] // heads, intermediate_size=d["intermediate_size"],
                   vocab_size=d["vocab_size"],
                   target_hidden_size=(d.get("headstart") or {}).get("target_hidden_size", d["hidden_size"]),
                   aux_layer_ids=tuple(i + 1 for i in dflash["target_layer_ids"]),
                   target_num_layers=d["num_target_layers"], block_size=int(block),
                   mask_token_id=int(dflash["mask_token_id"]), rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                   rope_theta=theta, rope_scaling=scaling, max_position_embeddings=d.get("max_position_embeddings", 4096),
                   hidden_act=d.get("hidden_act", "silu"), **cls.own_fields(d, where))

    @classmethod
    def own_fields(cls, d: dict, where: str) -> dict:
        """A variant's own fields read from its config.json (DFlash has none)."""
        return {}

    def own(self) -> dict:
        """A variant's own fields as its config.json writes them (DFlash has none)."""
        return {}

    @classmethod
    def read_fields(cls, d: dict, where: str, names: tuple[str, ...], top_level_first: bool = False) -> dict:
        """A variant's fields from its config.json, each from ``dflash_config`` or else the top level (or the other way
        round, ``top_level_first``: where the servers read them); refused by name where one is in neither."""
        inner = d.get("dflash_config") or {}
        read = {k: d.get(k, inner.get(k)) if top_level_first else inner.get(k, d.get(k)) for k in names}
        missing = [k for k, v in read.items() if v is None]
        if missing:
            raise ValueError(f"{where}: a {cls.variant} config needs {missing}")
        return read

    @classmethod
    def from_json(cls, path: str | Path) -> "DFlashConfig":
        return cls.from_hf_dict(json.loads(Path(path).read_text()), str(path))

    def check_target(self, target_config) -> None:
        """Refuse, before any training or decoding, a config that does not fit the target."""
        tc = text_config(target_config)
        problems = []
        for key, mine, theirs in (("target hidden size", self.target_hidden_size, tc.hidden_size),
                                  ("hidden_size", self.hidden_size, tc.hidden_size),
                                  ("vocab_size", self.vocab_size, tc.vocab_size),
                                  ("num_target_layers", self.target_num_layers, tc.num_hidden_layers)):
            if mine != theirs:
                problems.append(f"{key} {mine} != the target's {theirs}")
        if not 0 <= self.mask_token_id < tc.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} is not a token of the target's vocab ({tc.vocab_size})")
        if self.block_size < 2:
            problems.append(f"block_size {self.block_size}: a block holds the bonus token and at least one mask")
        try:
            check_servable_ids(self.aux_layer_ids, tc.num_hidden_layers)
        except ValueError as err:
            problems.append(str(err))
        if problems:
            raise ValueError(f"the {self.variant} draft config does not fit the target:\n  " + "\n  ".join(problems))

    def qwen3_config(self) -> Qwen3Config:
        """A Qwen3Config for the HF building blocks (RMSNorm, MLP, rotary embedding)."""
        return Qwen3Config(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                           head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, hidden_act=self.hidden_act,
                           rope_theta=self.rope_theta, rope_scaling=self.rope_scaling, vocab_size=self.vocab_size,
                           max_position_embeddings=max(self.max_position_embeddings, rope_original_max(self.rope_scaling)))
