"""P-EAGLE's recipe fields (``PEagleOptions``) and architecture (``PEagleConfig``): EAGLE-3's config plus the placeholder
token, written in the keys vLLM's parallel drafting reads (docs/FORMATS.md section B.1)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from headstart.heads.eagle3.config import Eagle3Config
from headstart.models.target import placeholder_token, text_config


@dataclass(frozen=True)
class PEagleOptions:
    """A P-EAGLE recipe's own ``draft:`` fields."""

    draft_vocab_size: int = 32000
    """Size of the draft vocab (the most frequent trained tokens); capped at the target vocab."""
    parallel_tokens: int = 8
    """K: the draft depths trained, the most tokens one draft forward proposes (speculators' ``num_depths``)."""
    step_weight: float = 1.0
    """Loss weight of depth k is step_weight**k (speculators and SpecForge weigh the depths alike: 1.0)."""
    feature_noise: float = 0.0
    """Std of Gaussian noise on the target's aux hidden states while training (as EAGLE-3's)."""
    fc_norm: bool = False
    """EAGLE-3.1's per-layer norm before ``fc`` (the placeholder feature goes through it too)."""
    down_sample_ratio: float = 1.0
    """COD (conditional-on-distribution) sampling: depth d >= 1 is trained at a random max(r**d, ``down_sample_ratio_min``)
    share of the positions, each depth's among the depth before's, so the later depths cost geometrically less
    (speculators' ``down_sample_ratio``, 0.7 there). 1.0: every depth at every position."""
    down_sample_ratio_min: float = 0.2
    """COD's floor on a depth's share of the positions (speculators' ``down_sample_ratio_min``)."""
    num_layers: int = 1
    """Decoder layers of the draft (EAGLE-3's ``num_layers``; the P-EAGLE paper drafts with 4)."""
    mask_token_id: int | None = None
    """The placeholder token of the not-yet-drafted positions; None: the target's pad token, else its eos token (the
    embedding is the target's, frozen, so any id works: ``mask_hidden`` is what training shapes)."""


@dataclass(frozen=True)
class PEagleConfig(Eagle3Config):
    """EAGLE-3's architecture plus the placeholder token id; serialised as the flat layout's config.json with
    ``mask_token_id`` and ``pard_token`` (vLLM's two readers of parallel drafting read one each)."""

    mask_token_id: int = 0
    parallel_tokens: int = 8
    """The depths it was trained for: a round drafts up to this many tokens."""

    speculators_type = "peagle"
    speculators_architectures = ("PEagleSpeculator",)

    @property
    def variant(self) -> str:
        return "P-EAGLE"

    @classmethod
    def from_target(cls, target_config, draft_vocab_size: int = 32000, aux_layer_ids=None, fc_norm: bool = False,
                    norm_output: bool = False, mask_token_id: int | None = None,
                    parallel_tokens: int = 8, num_layers: int = 1) -> "PEagleConfig":
        """EAGLE-3's config for ``target_config`` with the placeholder ``mask_token_id`` (None: the target's pad token,
        else its eos token) and ``parallel_tokens`` depths."""
        if norm_output:
            raise ValueError("P-EAGLE has no norm_output: its drafts carry no state from one to the next")
        base = super().from_target(target_config, draft_vocab_size, aux_layer_ids, fc_norm=fc_norm,
                                   num_layers=num_layers)
        token = placeholder_token(target_config) if mask_token_id is None else mask_token_id
        return dataclasses.replace(base, mask_token_id=int(token), parallel_tokens=parallel_tokens,
                                   speculative_tokens=min(base.speculative_tokens, parallel_tokens))

    def to_hf_dict(self) -> dict:
        d = super().to_hf_dict()
        # vLLM's V1 proposer reads mask_token_id (or pard_token), its V2 runner only pard_token: write both.
        d.update(mask_token_id=self.mask_token_id, pard_token=self.mask_token_id, parallel_drafting=True)
        d["headstart"]["parallel_tokens"] = self.parallel_tokens
        return d

    def to_speculators_dict(self, verifier: dict | None) -> dict:
        d = super().to_speculators_dict(verifier)
        d["mask_token_id"] = self.mask_token_id  # vLLM's update_peagle reads it (KeyError without)
        d["headstart"]["parallel_tokens"] = self.parallel_tokens
        return d

    @classmethod
    def flat_dict(cls, d: dict, where: str = "config.json") -> dict:
        flat = super().flat_dict(d, where)
        return flat if flat is d else {**flat, "mask_token_id": d.get("mask_token_id")}

    @classmethod
    def from_hf_dict(cls, d: dict) -> "PEagleConfig":
        token = d.get("mask_token_id", d.get("pard_token"))
        if token is None:
            raise ValueError("P-EAGLE config.json has neither mask_token_id nor pard_token: vLLM cannot place the "
                             "not-yet-drafted positions without it")
        if d.get("pard_token") is not None and d.get("mask_token_id") is not None and d["pard_token"] != d["mask_token_id"]:
            raise ValueError(f"P-EAGLE config.json: pard_token {d['pard_token']} != mask_token_id {d['mask_token_id']} "
                             "(vLLM's two proposers would place different tokens)")
        if d.get("norm_output"):
            raise ValueError("P-EAGLE config.json: norm_output is true, but a P-EAGLE head carries no state between "
                             "drafts (vLLM's parallel drafting ignores it)")
        base = super().from_hf_dict(d)
        return dataclasses.replace(base, mask_token_id=int(token),
                                   parallel_tokens=int((d.get("headstart") or {}).get("parallel_tokens", base.speculative_tokens)))

    def check_target(self, target_config) -> None:
        super().check_target(target_config)
        vocab = text_config(target_config).vocab_size
        if not 0 <= self.mask_token_id < vocab:
            raise ValueError(f"the P-EAGLE mask_token_id {self.mask_token_id} is not a token of the target's vocab "
                             f"({vocab})")
