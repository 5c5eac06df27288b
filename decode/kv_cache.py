"""A static, position-indexed KV cache that any HF decoder layer writes through ``Cache.update``.

K/V live in preallocated ``[B, kv_heads, max_len, head_dim]`` buffers. A forward over n new tokens
writes slots ``[length, length + n)`` and attends to ``[0, length + n)`` only, so rolling back is
moving ``length``: stale slots beyond it are overwritten by the next forward and never attended.
"""

from __future__ import annotations

from typing import Callable

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


def grown(buffer: torch.Tensor, needed: int, limit: int) -> torch.Tensor:
    """``buffer`` [B, heads, slots, head_dim] with room for ``needed`` slots: doubled (up to ``limit``), contents kept.
    A batch's caches grow on demand rather than holding ``max_len`` slots: dropping a finished row copies them."""
    slots = min(limit, max(needed, 2 * buffer.shape[2]))
    out = buffer.new_zeros(*buffer.shape[:2], slots, buffer.shape[3])
    out[:, :, : buffer.shape[2]] = buffer
    return out


def ragged_allowed(start: torch.Tensor, end: torch.Tensor, n: int, keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a batch's next n tokens per row go and what they see, from device tensors (a compiled step builds it inside
    its graph): row b's block of n at
    slots from start[b] [B], its real tokens ending at end[b] [B], over ``keys`` slots. Query i of row b sees the
    row's slots before start[b] and its own block up to itself, never past end[b]; a padding query sees at least
    itself (a query with no key, past a sliding window, would be NaN, and its NaN key would reach real queries
    through the masked product). Returns (allowed [B, n, keys], positions [B, n])."""
    slots = torch.arange(keys, device=start.device)  # [S]
    here = start[:, None, None] + torch.arange(n, device=start.device)[:, None]  # [B, n, 1]: each query's own slot
    allowed = (slots < start[:, None, None]) | ((slots <= here) & (slots < end[:, None, None])) | (slots == here)
    return allowed, here[:, :, 0]


def write_rows(buffer: torch.Tensor, slots: torch.Tensor, states: torch.Tensor) -> None:
    """buffer [B, heads, S, head_dim][b, :, slots[b, i]] = states [B, heads, n, head_dim][b, :, i]."""
    rows = torch.arange(buffer.shape[0], device=slots.device)[:, None]
    buffer[rows, :, slots] = states.transpose(1, 2)  # the indexed view is [B, n, heads, head_dim]


class StaticRaggedKVLayer(PositionalKVLayer):
    """One layer of a batch whose rows hold different numbers of tokens, with static shapes for a compiled forward: [B, heads, max_len, head_dim] buffers,
    row b's block written from ``starts[b]`` (a device tensor the cache fills: changing it recompiles nothing), and the
    first ``visible`` slots returned, the caller's mask hiding every slot a row has not committed or is not writing."""

    is_compileable = True

    def __init__(self, max_len: int, grow: bool = False) -> None:
        super().__init__(max_len)
        self.starts: torch.Tensor | None = None  # [B], the cache's
        self.visible = max_len  # the leading slots attention reads (the cache's key window; a graph each)
        self.grow = grow  # eager use: buffers start at 256 slots and grow, as a long context's max_len would not fit

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, heads, _, dim = key_states.shape
        slots = min(self.max_len, max(256, self.visible)) if self.grow else self.max_len
        self.keys = key_states.new_zeros(B, heads, slots, dim)
        self.values = value_states.new_zeros(B, heads, slots, value_states.shape[-1])
        self.is_initialized = True
        if not self.grow:
            static_address(self.keys, self.values)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.visible > self.keys.shape[2]:  # only when growing: a static buffer holds max_len
            self.keys, self.values = grown(self.keys, self.visible, self.max_len), grown(self.values, self.visible, self.max_len)
        slots = self.starts[:, None] + torch.arange(key_states.shape[-2], device=key_states.device)  # [B, n]
        write_rows(self.keys, slots, key_states)
        write_rows(self.values, slots, value_states)
        return self.keys[:, :, : self.visible], self.values[:, :, : self.visible]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.visible, 0


def static_address(*buffers: torch.Tensor) -> None:
    """Buffers a compiled step writes in place keep fixed addresses: what CUDA graphs replay against (outside a
    compiled graph only: inside one ``mark_static_address`` cannot run)."""
    if not torch.compiler.is_compiling():
        for buffer in buffers:
            torch._dynamo.mark_static_address(buffer)


def key_window(needed: int, max_len: int) -> int:
    """The key window a compiled batched block attends over: the smallest of 128, 256, 512, ... (then ``max_len``)
    that holds ``needed`` slots. Attending over every ``max_len`` slot costs what a short generation never uses -- on a
    CPU a batch of 4 on the demo target verified in 17 ms over 1,024 slots against 13 eagerly over the ~250 used."""
    window = 128
    while window < needed:
        window *= 2
    return min(window, max_len)


class StaticRaggedKVCache(Cache):
    """A batch whose rows hold different numbers of committed tokens (``lengths``, one per row): row b's block is
    written from its own slot, committing is moving a row's length (a chain's rejected drafts are simply overwritten),
    and the buffers' shapes never change (a compiled runner's). A finished row is not dropped (that would change the batch, and recompile):
    it stays in the buffers as a dead row that writes its padding at slot 0 and is never read. ``live`` maps the
    caller's rows (the unfinished ones, in order) to buffer rows. ``compact`` (eager use): buffers of 256 slots grown
    on demand rather than ``max_len`` (a long-context model's whole window for every row), and a finished row dropped
    from them."""

    def __init__(self, num_layers: int, max_len: int, device: torch.device, compact: bool = False) -> None:
        super().__init__(layers=[StaticRaggedKVLayer(max_len, grow=compact) for _ in range(num_layers)])
        self.max_len = max_len
        self.device = device
        self.compact = compact
        self.lengths: list[int] = []  # per live row
        self.live: list[int] = []
        self.starts = torch.zeros(0, dtype=torch.long, device=device)
        self._kept: dict[int, tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]] = {}  # other batch sizes'

    @property
    def batch(self) -> int:
        return self.starts.shape[0]

    def reset(self, batch: int) -> None:
        """Empty rows for a batch of this size. Compiled, each size keeps its own buffers (and its own graphs): a
        benchmark whose last batch is smaller goes back and forth without reallocating, which a CUDA graph would record
        again."""
        self.lengths, self.live = [0] * batch, list(range(batch))
        if batch == self.batch:
            return
        if self.layers[0].is_initialized and not self.compact:
            self._kept[self.batch] = (self.starts, [(layer.keys, layer.values) for layer in self.layers])
        if batch in self._kept:
            self.starts, buffers = self._kept.pop(batch)
        else:
            self.starts, buffers = torch.zeros(batch, dtype=torch.long, device=self.device), None
            if not self.compact:
                static_address(self.starts)
        for i, layer in enumerate(self.layers):
            layer.starts, layer.is_initialized = self.starts, buffers is not None
            if buffers is not None:
                layer.keys, layer.values = buffers[i]

    def begin(self, visible: int, starts: list[int]) -> None:
        """Before a forward: buffer row b writes from slot starts[b] (a dead row: 0) and attention reads the first
        ``visible`` slots."""
        self.starts.copy_(torch.tensor(starts), non_blocking=True)  # in place: the compiled graph reads this tensor
        for layer in self.layers:
            layer.visible = visible

    @property
    def visible(self) -> int:
        return self.layers[0].visible

    def commit(self, counts: list[int]) -> None:
        self.lengths = [n + c for n, c in zip(self.lengths, counts)]

    def select(self, rows: list[int]) -> None:
        """Keep only these live rows, in this order: the others become dead rows (nothing is copied), or with
        ``compact`` leave the buffers."""
        self.live = [self.live[r] for r in rows]
        self.lengths = [self.lengths[r] for r in rows]
        if self.compact:
            index = torch.tensor(self.live, dtype=torch.long, device=self.device)
            self.starts = torch.zeros(len(rows), dtype=torch.long, device=self.device)
            for layer in self.layers:
                layer.starts = self.starts
                if layer.is_initialized:
                    layer.keys, layer.values = layer.keys[index], layer.values[index]
            self.live = list(range(len(rows)))


class StaticKVLayer(PositionalKVLayer):
    """A ``PositionalKVLayer`` with static shapes, for a compiled forward (``torch.compile``, CUDA graphs): the
    write slot is a device tensor shared by every layer (changing it recompiles nothing) and attention reads the
    whole ``max_len`` buffer, the caller's mask hiding every slot that is not committed or in this block."""

    is_compileable = True

    def __init__(self, max_len: int, write_at: torch.Tensor) -> None:
        super().__init__(max_len)
        self.write_at = write_at

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        static_address(self.keys, self.values)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        slots = self.write_at + torch.arange(key_states.shape[-2], device=key_states.device)
        self.keys.index_copy_(2, slots, key_states)
        self.values.index_copy_(2, slots, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_len, 0


class StaticKVCache(PositionalKVCache):
    """``PositionalKVCache`` (same length, rollback and tree ``keep``) over ``StaticKVLayer``s on ``device``; the
    caller checks that a block fits in ``max_len`` (an index past it fails inside the compiled graph)."""

    def __init__(self, num_layers: int, max_len: int, device: torch.device) -> None:
        self.write_at = torch.zeros((), dtype=torch.long, device=device)
        torch._dynamo.mark_static_address(self.write_at)
        Cache.__init__(self, layers=[StaticKVLayer(max_len, self.write_at) for _ in range(num_layers)])
        self.max_len = max_len
        self.length = 0
        self.mover: Callable | None = None  # ``move_slots`` compiled, set by a compiled TargetRunner

    def begin(self, start: int | None = None) -> None:
        start = self.length if start is None else start
        for layer in self.layers:
            layer.start = start
        self.write_at.fill_(start)  # in place: the compiled graph reads this tensor

    @torch.no_grad()  # the grad mode the mover was compiled in (TargetRunner.precompile): another would recompile
    def keep(self, slots: torch.Tensor) -> None:
        """``PositionalKVCache.keep``, every layer's moves in one call of ``mover`` when set (``move_slots`` compiled
        with dynamic sizes: a graph for one slot and one for more): layer by layer it is 4 eager ops a layer, ~120 for
        a 30-layer target, each a kernel launch on a GPU."""
        if self.mover is None:
            return super().keep(slots)
        dst = torch.arange(self.length, self.length + slots.numel(), device=slots.device)
        layers = [layer for layer in self.layers if layer.is_initialized]
        if self.write_at.is_cuda:
            torch.compiler.cudagraph_mark_step_begin()
        self.mover([layer.keys for layer in layers], [layer.values for layer in layers], slots, dst)
        self.length += slots.numel()


def move_slots(keys: list[torch.Tensor], values: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Every layer's K/V at slots ``src`` copied to ``dst`` (a tree's accepted path, into place)."""
    for buffer in (*keys, *values):
        buffer.index_copy_(2, dst, buffer.index_select(2, src))
