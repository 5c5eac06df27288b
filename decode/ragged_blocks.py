"""A batched drafter's layer over a ragged batch, eager or compiled: what ``RaggedRunner`` does for the target, for the
one-layer drafts (EAGLE-3, MTP) that keep their own KV cache.

``step(hidden [B, m, W], tokens [B, m], positions [B, m], allowed [B, m, S], cache) -> out [B, m, ...]`` (or a tuple
of such) runs a block of m pairs per row: row b's written at slots starts[b]... of ``cache`` (a one-layer
``StaticRaggedKVCache``, whose ``update`` returns the first S slots), seeing what ``allowed`` says. Compiled, the rows
keep the batch's size to the end: a row the loop drops stays as a dead row (one padding pair at slot 0, never read), so
the shapes -- and the graphs -- never change; a block is padded to a compiled width and attends over a key window
(``key_window``), its mask and positions built inside the graph; prompts run eagerly. Eager, a dropped row leaves the
buffers and a block attends over exactly the keys it needs.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from headstart.decode.kv_cache import StaticRaggedKVCache, key_window, ragged_allowed
from headstart.decode.static_blocks import COMPILED_BLOCK, compile_step, padded_size


class RaggedBlocks:
    graphs = 0
    """Graphs compiled by every instance: they share ``_run``'s code object, so dynamo's recompile limit counts them
    together (``precompile`` raises it to what they need, else the graphs past it would quietly run eagerly)."""

    def __init__(self, step: Callable, max_len: int, device: torch.device, compile: bool = False,
                 backend: str = "inductor", num_layers: int = 1, name: str = "draft") -> None:
        """``num_layers``: the cache's layers (a drafter's one; the target's all, ``RaggedRunner(compile=True)``);
        ``name``: whose cache an overflow error names."""
        self.step = step
        self.max_len = max_len
        self.device = device
        self.name = name
        self.cache = StaticRaggedKVCache(num_layers, max_len, device, compact=not compile)
        self.compiled = compile_step(self._run, device, backend) if compile else None
        self.sizes: dict[int, set[int]] = {}  # compiled widths, by batch size

    @property
    def lengths(self) -> list[int]:
        """Committed pairs per live row."""
        return self.cache.lengths

    def reset(self, batch: int) -> None:
        self.cache.reset(batch)

    def commit(self, counts: list[int]) -> None:
        self.cache.commit(counts)

    def select(self, rows: list[int]) -> None:
        self.cache.select(rows)

    def __call__(self, hidden: torch.Tensor | None, tokens: torch.Tensor, starts: list[int], valid: list[int]):
        """The live rows' pairs (hidden [b, n, W] or None -- the target reads tokens only -- and tokens [b, n]): row i's
        first valid[i] written at slots starts[i]... and attending causally to every slot before them. Returns the
        step's output(s), [b, n, ...] each (None stays None)."""
        cache = self.cache
        n = tokens.shape[1]
        eager = self.compiled is None or min(starts) == 0 or n > COMPILED_BLOCK
        sizes = self.sizes.setdefault(cache.batch, set())
        m = n if eager else padded_size(sizes, n, self.max_len - max(starts))
        needed = max(starts) + m
        if needed > self.max_len:
            raise ValueError(f"{self.name} KV cache overflow: {needed} tokens > max_len {self.max_len} (raise --max-len)")
        # Every buffer row live and no padding (always so eagerly, but for a shorter row's padding): the block as it is.
        dense = m == n and cache.live == list(range(cache.batch))
        live = None if dense else torch.tensor(cache.live, device=self.device)
        if not dense:
            hidden = None if hidden is None else place(hidden, live, cache.batch, m)
            tokens = place(tokens, live, cache.batch, m)
        elif not eager:  # fresh strides: a slice of a longer block (a commit's states) would recompile the graph
            hidden = None if hidden is None else hidden.contiguous()
            tokens = tokens.contiguous()
        row_starts, ends = [0] * cache.batch, [1] * cache.batch  # a dead row: one pair at slot 0, its own
        for row, start, v in zip(cache.live, starts, valid):
            row_starts[row], ends[row] = start, start + v
        cache.begin(needed if eager else key_window(needed, self.max_len), row_starts)  # a prompt: exactly its keys
        ends = torch.tensor(ends, device=self.device)
        if eager:
            out = self._run(hidden, tokens, ends)
        else:
            sizes.add(m)
            if self.device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()
            out = self.compiled(hidden, tokens, ends)
        # The live rows' first n columns: a gather copies them out of a CUDA graph's buffers, which its next replay
        # overwrites; a dense block's outputs are those buffers, copied on a GPU.
        copy = not eager and self.device.type == "cuda"

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            return (t.clone() if copy else t) if dense else t[live, :n]

        return tuple(map(pick, out)) if isinstance(out, tuple) else pick(out)

    def _run(self, hidden: torch.Tensor, tokens: torch.Tensor, ends: torch.Tensor):
        """The step over the whole batch's block, its mask and positions built from the cache's starts (in the graph
        when compiled); the key window is a Python int (a graph each)."""
        allowed, positions = ragged_allowed(self.cache.starts, ends, tokens.shape[1], self.cache.visible)
        return self.step(hidden, tokens, positions, allowed, self.cache)

    @torch.no_grad()
    def precompile(self, batch: int, sizes: Iterable[int], width: int | None = None, dtype: torch.dtype | None = None) -> None:
        """Compile blocks of ``sizes`` pairs (hidden of ``width`` features in ``dtype``; None: tokens only) for ``batch``
        rows, at every key window, on dummy pairs at slot 0, so nothing compiles mid-generation (a block runs at the
        smallest compiled width that holds it). Leaves the cache reset to ``batch`` empty rows."""
        if self.compiled is None:
            return
        cache = self.cache
        cache.reset(batch)
        done = self.sizes.setdefault(batch, set())
        windows = sorted({key_window(n, self.max_len) for n in range(1, self.max_len + 1)})
        todo = sorted(m for m in set(sizes) - done if 0 < m <= min(COMPILED_BLOCK, self.max_len))
        RaggedBlocks.graphs += sum(m <= window for m in todo for window in windows)
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, RaggedBlocks.graphs + 8)
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * config.recompile_limit)

        def dummies(m: int):
            hidden = None if width is None else torch.zeros(batch, m, width, device=self.device, dtype=dtype)
            return hidden, torch.zeros(batch, m, dtype=torch.long, device=self.device), torch.full((batch,), m, device=self.device)

        if not cache.layers[0].is_initialized:  # the buffers, eagerly: fixed addresses for CUDA graphs
            cache.begin(self.max_len, [0] * batch)
            self._run(*dummies(1))
        for m in todo:
            for window in windows:
                if m <= window:
                    cache.begin(window, [0] * batch)
                    if self.device.type == "cuda":
                        torch.compiler.cudagraph_mark_step_begin()
                    self.compiled(*dummies(m))
            done.add(m)
        cache.reset(batch)


def place(rows: torch.Tensor, live: torch.Tensor, batch: int, m: int) -> torch.Tensor:
    """The live rows' block [b, n, ...] in the whole batch's [batch, m, ...] (at buffer rows ``live``), zeros elsewhere."""
    out = rows.new_zeros(batch, m, *rows.shape[2:])
    out[live, : rows.shape[1]] = rows
    return out
