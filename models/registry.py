"""The explicit registry of draft heads: a name in the config picks a builder; unknown names fail."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from headstart.models.draft_vocab import build_draft_vocab
from headstart.models.eagle3 import Eagle3Config, Eagle3Draft
from headstart.models.head import DraftHead
from headstart.models.target import Target


@dataclass(frozen=True)
class DraftConfig:
    """Which head to train and its shape."""

    head: str = "eagle3"
    """Registered head name: one of HEADS."""
    config: str | None = None
    """Draft config JSON (server format); None derives one from the target config."""
    draft_vocab_size: int = 32000
    """Size of the draft vocab (most frequent trained tokens); capped at the target vocab."""
    ttt_steps: int = 7
    """Training-time-test unroll length (EAGLE-3)."""
    step_weight: float = 0.8
    """Loss weight of TTT step k is step_weight**k."""


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
    head.set_draft_vocab(*build_draft_vocab(token_counts, draft_config.draft_vocab_size))
    head.load_target_embeddings(target.embed_tokens.weight)
    return head


HEADS: dict[str, Callable[[DraftConfig, Target, torch.Tensor], DraftHead]] = {"eagle3": build_eagle3}


def build_head(config: DraftConfig, target: Target, token_counts: torch.Tensor) -> DraftHead:
    if config.head not in HEADS:
        raise ValueError(f"unknown draft head {config.head!r}; registered heads: {sorted(HEADS)}")
    return HEADS[config.head](config, target, token_counts)
