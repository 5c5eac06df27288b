"""What every draft head sees (``Features``) and what the trainer asks of it (``DraftHead``).

Online capture and the offline feature store both produce ``Features``; the trainer only calls the
methods of ``DraftHead``. Everything particular to one head stays in that head's file.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol, runtime_checkable

import torch


@dataclass
class Features:
    input_ids: torch.Tensor  # [B, T] int64
    loss_mask: torch.Tensor  # [B, T] 1 where the token is trained (assistant tokens), 0 elsewhere and on padding
    aux_hidden_states: torch.Tensor  # [B, T, n*H_t] target residual streams at the aux layer ids
    target_logits: torch.Tensor  # [B, T, V_d] target logits at each position, restricted to the draft vocab
    target_in_draft: torch.Tensor  # [B, T] bool: the target's full-vocab argmax lies in the draft vocab

    def to(self, device: torch.device | str) -> "Features":
        return Features(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


@runtime_checkable
class DraftHead(Protocol):
    def target_vocab_ids(self) -> torch.Tensor:
        """[V_d] target token id of each draft-vocab entry: which target logits ``Features`` carries."""

    def loss(self, features: Features) -> tuple[torch.Tensor, dict[str, float]]:
        """Scalar training loss and metrics (floats, already reduced over this batch).

        ``forward`` must return the same, so that sharding wrappers see the call."""

    def save_pretrained(self, directory: str) -> None:
        """Write the head in the server format it is loaded from (config.json + model.safetensors)."""
