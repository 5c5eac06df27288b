"""DSpark's recipe fields (``DSparkOptions``) and architecture (``DSparkConfig``: DFlash's plus the Markov head's and the
confidence head's), serialised as the config.json vLLM (``Qwen3DSparkModel``), SGLang (``DSparkDraftModel``) and
SpecForge read (docs/FORMATS.md section L)."""

from __future__ import annotations

from dataclasses import dataclass

from headstart.heads.dflash.config import DFlashConfig

MARKOV_HEADS = ("vanilla", "gated")
"""``vanilla``: bias = W2 W1[prev]; ``gated``: W2 (sigmoid(G [h; W1[prev]] + g) * W1[prev]). DeepSpec's ``rnn`` head
(a GRU over the block) is not implemented here."""


@dataclass(frozen=True)
class DSparkOptions:
    """A DSpark recipe's own ``draft:`` fields (defaults: DeepSpec's Qwen3 recipes, but one layer)."""

    block_size: int = 7
    """B: the block one draft forward fills -- the bonus token and B-1 masks -- and the drafts it gives: slot i predicts
    the token after its own position (DeepSpec's and vLLM's convention), so a block drafts B tokens, not B-1."""
    num_layers: int = 1
    """Draft decoder layers (the published 8B heads have 5)."""
    anchors: int = 64
    """Blocks trained per sequence and step (DeepSpec's ``num_anchors``, 512 at 8B's sequence lengths)."""
    decay_gamma: float = 4.0
    """Draft j's loss terms weighted exp(-(j-1)/gamma) (DeepSpec's ``loss_decay_gamma``; 0 weighs them alike)."""
    markov_rank: int = 256
    """r: the Markov head's rank -- an [V, r] embedding of the previous token and an [r, V] map to a logit bias."""
    markov_head_type: str = "vanilla"
    """``vanilla`` or ``gated`` (``MARKOV_HEADS``)."""
    confidence_head: bool = True
    """Train the confidence head (DeepSpec's ``AcceptRatePredictor``): each draft's acceptance predicted from its slot's
    state, which the decoder's ``--confidence-threshold`` stops a block on."""
    confidence_head_with_markov: bool = True
    """The confidence head also reads the previous token's Markov embedding W1[prev]."""
    ce_alpha: float = 0.1
    """The cross-entropy term's weight (against the data's next token)."""
    l1_alpha: float = 0.9
    """The L1 term's weight: sum |p - q| = 2 TV(p, q) between the target's p and the draft's q (DeepSpec's and SpecForge's
    ``l1_loss_alpha``; speculators' ``{"tv": 0.9}`` is this at 0.45)."""
    confidence_alpha: float = 1.0
    """The confidence head's BCE weight, against the draft's soft acceptance 1 - TV(p, q) (detached)."""
    mask_token_id: int | None = None
    """The masked positions' token; None: the target's pad token, else its eos token."""


@dataclass(frozen=True)
class DSparkConfig(DFlashConfig):
    """DFlash's architecture plus the Markov and confidence heads'."""

    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True

    variant = "DSpark"
    architecture = "DSparkDraftModel"

    def __post_init__(self) -> None:
        problems = []
        if self.markov_rank < 0:
            problems.append(f"markov_rank must be >= 0, got {self.markov_rank}")
        if self.markov_head_type not in MARKOV_HEADS:
            problems.append(f"markov_head_type {self.markov_head_type!r}: headstart implements {list(MARKOV_HEADS)}")
        if self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            problems.append("confidence_head_with_markov needs a Markov head (markov_rank > 0)")
        if problems:
            raise ValueError("DSpark config: " + "; ".join(problems))

    def own(self) -> dict:
        return {"markov_rank": self.markov_rank, "markov_head_type": self.markov_head_type,
                "enable_confidence_head": self.enable_confidence_head,
                "confidence_head_with_markov": self.confidence_head_with_markov}

    def to_hf_dict(self) -> dict:
        """DFlash's config.json with DSpark's architecture and fields. vLLM and SGLang read the fields at the top level
        (vLLM maps ``DSparkDraftModel`` of ``model_type: qwen3`` to its ``Qwen3DSparkModel``); SpecForge and z-lab-style
        readers read ``dflash_config``: both carry them, and the block size and mask token."""
        d = super().to_hf_dict()
        d.update(self.own(), mask_token_id=self.mask_token_id, target_layer_ids=d["dflash_config"]["target_layer_ids"])
        # SpecForge's DSparkDraftModel refuses a draft whose key/value heads equal its heads unless told "mha"
        d["dflash_config"].update(projector_type="dspark",
                                  attention_mode="mha" if self.num_key_value_heads == self.num_attention_heads else "gqa")
        return d

    @classmethod
    def own_fields(cls, d: dict, where: str) -> dict:
        read = cls.read_fields(d, where, ("markov_rank", "markov_head_type", "enable_confidence_head",
                                          "confidence_head_with_markov"), top_level_first=True)
        return {"markov_rank": int(read["markov_rank"]), "markov_head_type": str(read["markov_head_type"]).lower(),
                "enable_confidence_head": bool(read["enable_confidence_head"]),
                "confidence_head_with_markov": bool(read["confidence_head_with_markov"])}
