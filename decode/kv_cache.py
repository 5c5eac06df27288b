"""A static, position-indexed KV cache that any HF decoder layer writes through ``Cache.update``.

K/V live in preallocated ``[B, kv_heads, max_len, head_dim]`` buffers. A forward over n new tokens
writes slots ``[length, length + n)`` and attends to ``[0, length + n)`` only, so rolling back is
moving ``length``: stale slots beyond it are overwritten by the next forward and never attended.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class PositionalKVLayer(CacheLayerMixin):
    is_compileable = False
    is_sliding = False

    def __init__(self, max_len: int) -> None:
        super().__init__()
        self.max_len = max_len
        self.start = 0  # where this forward's tokens are written (set by the cache)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, heads, _, _ = key_states.shape
        self.keys = key_states.new_zeros(B, heads, self.max_len, key_states.shape[-1])
        self.values = value_states.new_zeros(B, heads, self.max_len, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.start + key_states.shape[-2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} tokens > max_len {self.max_len}")
        self.keys[:, :, self.start : end] = key_states
        self.values[:, :, self.start : end] = value_states
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.start + query_length, 0

    def get_seq_length(self) -> int:
        return self.start

    def get_max_length(self) -> int:
        return self.max_len


class PositionalKVCache(Cache):
    """All layers share one ``length``: the number of valid (committed) slots."""

    def __init__(self, num_layers: int, max_len: int) -> None:
        super().__init__(layers=[PositionalKVLayer(max_len) for _ in range(num_layers)])
        self.max_len = max_len
        self.length = 0

    @property
    def device(self) -> torch.device:
        first = self.layers[0]
        return first.keys.device if first.is_initialized else torch.device("cpu")

    def begin(self, start: int | None = None) -> None:
        """Called before a forward: new tokens go to slots from ``start`` (default: right after the
        committed ones; a drafter growing a tree writes after its earlier speculative nodes)."""
        for layer in self.layers:
            layer.start = self.length if start is None else start

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.max_len:
            raise ValueError(f"cannot roll back to {length} (max_len {self.max_len})")
        self.length = length

    def keep(self, slots: torch.Tensor) -> None:
        """Move the K/V at absolute ``slots`` [m] (ascending, all >= the new start) to the m slots
        right after the committed length, and commit them: the accepted path of a tree."""
        dst = torch.arange(self.length, self.length + slots.numel(), device=slots.device)
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys[:, :, dst] = layer.keys[:, :, slots]
                layer.values[:, :, dst] = layer.values[:, :, slots]
        self.length += slots.numel()
