"""Residual blocks several heads stack (Medusa's heads, Hydra's, the early-exit adapter)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ResidualBlock(nn.Module):
    """``num_layers`` times x <- x + SiLU(W x + b); the module names are vLLM's (``layers.{j}``)."""

    def __init__(self, hidden_size: int, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=True) for _ in range(num_layers))
        for layer in self.layers:  # zero: the block starts as the identity
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x
