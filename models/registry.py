"""The explicit registry of draft heads: a name in the config picks a head type; unknown names fail.

A head type is its module class (which declares ``needs`` and loads a finished head with
``load(directory, target)``) and a builder that makes a fresh head for a target and its data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from headstart.models.draft_vocab import build_draft_vocab
from headstart.models.eagle3 import Eagle3Config, Eagle3Draft
from headstart.models.head import DraftHead
from headstart.models.medusa import MedusaConfig, MedusaHeads
from headstart.models.mtp import MTPHead, build_mtp
from headstart.models.provenance import check_record, check_target
from headstart.models.target import Target


@dataclass(frozen=True)
class DraftConfig:
    """Which head to train and its shape."""

    head: str = "eagle3"
    """Registered head name: one of HEADS."""
    config: str | None = None
    """Draft config JSON (server format); None derives one from the target config."""
    draft_vocab_size: int = 32000
    """Size of the draft vocab (most frequent trained tokens); capped at the target vocab (EAGLE-3)."""
    ttt_steps: int = 7
    """Training-time-test unroll length (EAGLE-3), or MTP's unrolled recurrent steps."""
    step_weight: float = 0.8
    """Loss weight of TTT / MTP step k (EAGLE-3, MTP), or of Medusa head k+1, is step_weight**k."""
    num_heads: int = 4
    """Medusa heads K: head i predicts the token i+1 positions after the next one."""
    num_layers: int = 1
    """ResBlocks per Medusa head."""
    truncated_vocab_size: int | None = None
    """Medusa: each head predicts only the N most frequent trained tokens (vLLM's token_map layout; smaller
    exports and cheaper heads, a token outside them is never drafted); None = the target's full vocab."""
    labels: str = "target"
    """What Medusa heads learn: target (the target's own distribution, self-distillation) | data (the data's tokens)."""
    loss_chunk_tokens: int = 1024
    """Positions per [chunk, V] float32 logits block of the loss (every head: EAGLE-3 over V_d, Medusa and MTP over
    the full vocab); lower it to save memory."""


@dataclass(frozen=True)
class HeadType:
    cls: type
    """The head's module class: its ``needs`` and ``load(directory, target)``."""
    build: Callable[[DraftConfig, Target, torch.Tensor], DraftHead]
    """(config, target, loss-masked token counts [V]) -> a fresh head for that target."""
    fields: tuple[str, ...]
    """The DraftConfig fields this head reads (its recipe, as cards and logs show it)."""


def build_eagle3(config: DraftConfig, target: Target, token_counts: torch.Tensor) -> Eagle3Draft:
    if config.config:
        draft_config = Eagle3Config.from_json(config.config)
    else:
        draft_config = Eagle3Config.from_target(target.config, config.draft_vocab_size, target.aux_layer_ids)
    draft_config.check_target(target.config)
    if tuple(draft_config.aux_layer_ids) != tuple(target.aux_layer_ids):
        raise ValueError(f"the draft config reads layers {list(draft_config.aux_layer_ids)} but the target is set "
                         f"to capture {list(target.aux_layer_ids)}; set target.aux_layer_ids to match")
    head = Eagle3Draft(draft_config, ttt_steps=config.ttt_steps, step_weight=config.step_weight)
    head.chunk_tokens = config.loss_chunk_tokens
    head.set_draft_vocab(*build_draft_vocab(token_counts, draft_config.draft_vocab_size))
    head.load_target_embeddings(target.embed_tokens.weight)
    return head


def build_medusa(config: DraftConfig, target: Target, token_counts: torch.Tensor) -> MedusaHeads:
    if config.config:
        medusa_config = MedusaConfig.from_hf_dict(json.loads(Path(config.config).read_text()), config.config)
    else:
        medusa_config = MedusaConfig.from_target(target.config, config.num_heads, config.num_layers,
                                                 config.truncated_vocab_size)
    medusa_config.check_target(target.config)
    head = MedusaHeads(medusa_config, step_weight=config.step_weight, labels=config.labels,
                       chunk_tokens=config.loss_chunk_tokens)
    if medusa_config.truncated:  # the most frequent trained tokens, ascending (EAGLE-3's draft vocab rule)
        _, t2d = build_draft_vocab(token_counts, medusa_config.draft_vocab_size)
        head.set_token_map(t2d.nonzero().squeeze(1))
    head.load_target_lm_head(target.lm_head_weight)
    head.set_teacher(target.vocab_head())
    return head


HEADS: dict[str, HeadType] = {
    "eagle3": HeadType(Eagle3Draft, build_eagle3, ("draft_vocab_size", "ttt_steps", "step_weight")),
    "medusa": HeadType(MedusaHeads, build_medusa, ("num_heads", "num_layers", "truncated_vocab_size", "labels",
                                                   "step_weight")),
    "mtp": HeadType(MTPHead, lambda c, t, _: build_mtp(t, c.ttt_steps, c.step_weight, c.loss_chunk_tokens),
                    ("ttt_steps", "step_weight")),
}


SHARED_FIELDS = ("head", "config", "loss_chunk_tokens")
"""DraftConfig fields every head reads; the rest belong to the heads that list them."""


def check_draft_keys(keys, where: str = "draft") -> None:
    """Refuse a recipe's draft section that sets a field its head does not read (a Medusa recipe with
    ``ttt_steps`` would otherwise train without it, silently), naming the field and the head's fields."""
    keys = dict(keys)
    name = keys.get("head", DraftConfig.head)
    own = head_type(name).fields
    foreign = sorted(k for k in keys if k not in own and k not in SHARED_FIELDS and k in DraftConfig.__dataclass_fields__)
    if foreign:
        raise ValueError(f"{', '.join(f'{where}.{k}' for k in foreign)}: not read by the {name} head; its fields are "
                         f"{list(own)} (and {list(SHARED_FIELDS)} for every head)")


def head_type(name: str) -> HeadType:
    if name not in HEADS:
        raise ValueError(f"unknown draft head {name!r}; registered heads: {sorted(HEADS)}")
    return HEADS[name]


def build_head(config: DraftConfig, target: Target, token_counts: torch.Tensor) -> DraftHead:
    return head_type(config.head).build(config, target, token_counts)


def load_head(name: str, directory: str, target, allow_other_target: bool = False) -> DraftHead:
    """A finished head of type ``name`` from its exported directory, checked against ``target`` (a
    Target or TargetMatrices): refused by name if it records another head type or another target."""
    check_record(directory, name)
    check_target(directory, getattr(target, "path", None), allow_other_target)
    return head_type(name).cls.load(directory, target)
