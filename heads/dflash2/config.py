"""DFlash2's recipe fields (``DFlash2Options``) and architecture (``DFlash2Config``: DFlash's plus the convolutions' and
the candidate selector's), serialised as the config.json z-lab's ``DFlash2DraftModel`` and vLLM read
(docs/FORMATS.md section M)."""

from __future__ import annotations

from dataclasses import dataclass

from headstart.heads.dflash.config import DFlashConfig


@dataclass(frozen=True)
class DFlash2Options:
    """A DFlash2 recipe's own ``draft:`` fields: DFlash's, and z-lab's defaults for the additions."""

    block_size: int = 16
    """B: the bonus token and B-1 masks, B-1 drafts (as DFlash)."""
    num_layers: int = 1
    anchors: int = 64
    weighting: str = "dpace"
    """The unary (block) loss's draft weights: ``dpace`` or ``decay`` (as DFlash); the selector's term shares them."""
    decay_gamma: float = 4.0
    dpace_alpha: float = 0.5
    mask_token_id: int | None = None
    conv_kernel_size: int = 2
    """T: taps of each layer's two dynamic causal convolutions over the block (z-lab's ``conv_kernel_size``)."""
    conv_group_size: int = 16
    """Channels sharing one dynamic tap (z-lab's ``conv_group_size``); must divide the hidden size."""
    selector_rank: int = 256
    """r: the candidate selector's codebooks [V, r] and its state projection [r, H]."""
    selector_top_k: int = 16
    """Candidates the selector re-ranks at each slot: the unary logits' top k (the whole vocab where it is smaller)."""
    selector_alpha: float = 1.0
    """The selector's cross-entropy weight against the unary loss (SpecForge's ``dflash2_selector_loss_alpha``)."""


@dataclass(frozen=True)
class DFlash2Config(DFlashConfig):
    """DFlash's architecture plus the convolutions' and the selector's."""

    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16

    variant = "DFlash2"
    architecture = "DFlash2DraftModel"

    def __post_init__(self) -> None:
        problems = []
        if self.conv_kernel_size < 1:
            problems.append(f"conv_kernel_size must be >= 1, got {self.conv_kernel_size}")
        if self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
            problems.append(f"conv_group_size {self.conv_group_size} must divide hidden_size {self.hidden_size}")
        if self.selector_rank < 1 or not 1 <= self.selector_top_k <= self.vocab_size:
            problems.append(f"selector_rank {self.selector_rank} must be >= 1 and selector_top_k {self.selector_top_k} in "
                            f"1..{self.vocab_size}")
        if problems:
            raise ValueError("DFlash2 config: " + "; ".join(problems))

    def own(self) -> dict:
        return {"conv_kernel_size": self.conv_kernel_size, "conv_group_size": self.conv_group_size,
                "selector_rank": self.selector_rank, "selector_top_k": self.selector_top_k}

    def to_hf_dict(self) -> dict:
        """DFlash's config.json with z-lab's DFlash2 fields in ``dflash_config`` (where z-lab's loader and vLLM read
        them), its block size there too, and ``is_causal: false`` (the block attends both ways)."""
        return super().to_hf_dict() | {"is_causal": False}

    @classmethod
    def own_fields(cls, d: dict, where: str) -> dict:
        fields = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
        return {k: int(v) for k, v in cls.read_fields(d, where, fields).items()}
