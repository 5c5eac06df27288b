"""A drafter's step compiled at static shapes (``--compile``): what the target's ``TargetRunner(compile=True)`` does
for the verify forward, for the one-layer drafts (EAGLE-3, MTP) that keep their own KV cache.

A step runs n new tokens written at cache slots [start, start + n) under a mask ``allowed`` [n, start + n]. Compiled,
it must have the same shapes every call: the block is padded to the smallest size already compiled that holds it
(chain steps are 1 token, commits 1..k+1, tree levels up to top-k), the mask widened to every one of the cache's
``max_len`` slots (the slots past the block hidden), and the write slot is a device tensor the caller fills (changing
it recompiles nothing). Near the end of the cache a block too short for a padded size that still fits gets its own
graph. A padding token attends only to its own slot, past the block, and nothing attends to it.
Prompts (start 0) run eagerly on the same cache: a graph per prompt length would recompile at every prompt.
"""

from __future__ import annotations

from typing import Callable

import torch

COMPILED_BLOCK = 64
"""With ``compile``, blocks of up to this many tokens after a prompt (decode steps, verify blocks, trees; a drafter's
steps) run compiled, one graph per padded size; prompts run eagerly on the same cache (a graph per prompt length
would recompile at every prompt)."""


RECOMPILE_LIMIT = 64
"""Graphs kept per compiled function. dynamo guards a bound method's ``self`` by type, so the target's runner and a
draft model's runner share ``TargetRunner._run``'s graphs (a size each per block size), and torch's default of 8 would
quietly run the rest eagerly."""


def compile_step(fn: Callable, device: torch.device, backend: str = "inductor", dynamic: bool = False) -> Callable:
    """``torch.compile`` for a decode step: static shapes (``dynamic``: one graph for every size, where the sizes met
    mid-generation are too many to compile each), and CUDA graphs on a GPU (inductor's reduce-overhead)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    cuda_graphs = device.type == "cuda" and backend == "inductor"
    return torch.compile(fn, dynamic=dynamic, backend=backend, mode="reduce-overhead" if cuda_graphs else None)


def padded_size(sizes: set[int], n: int, room: int) -> int:
    """The size a block of n tokens runs at: the smallest already compiled that holds it and fits the ``room`` slots
    left in the cache (a chain's shorter rounds reuse the full round's graph), else n (a graph of its own)."""
    return min((size for size in sizes if n <= size <= room), default=n)


def self_mask(m: int, max_len: int, device: torch.device) -> torch.Tensor:
    """[m, max_len]: token i sees only slot i -- the mask of ``precompile``'s dummy block at slot 0."""
    slots = torch.arange(m, device=device)
    allowed = torch.zeros(m, max_len, dtype=torch.bool, device=device)
    allowed[slots, slots] = True
    return allowed


def causal_allowed(positions: torch.Tensor, keys: int) -> torch.Tensor:
    """[n, keys] bool, a chain block's mask: the token at slot ``positions[i]`` sees every slot up to its own."""
    return torch.arange(keys, device=positions.device)[None, :] <= positions.view(-1, 1)


class StaticBlocks:
    """Runs ``step(hidden [1, m, W], tokens [1, m], positions [1, m], allowed [m, max_len]) -> out [1, m, ...]`` (or a
    tuple of such) compiled at padded block sizes (prompts eagerly, at their own length), and returns the block's rows
    of each output. With ``write_at`` (the caller's write-slot tensor), ``causal`` runs a chain block -- slot s at
    rotary position s, seeing every slot up to its own -- with its positions and mask built inside the graph: on a GPU
    the eager kernels that built them cost more than the graph's replay (a commit: 16-26 of them)."""

    def __init__(self, step: Callable, max_len: int, device: torch.device, backend: str = "inductor",
                 write_at: torch.Tensor | None = None) -> None:
        self.step = step
        self.max_len = max_len
        self.device = device
        self.compiled = compile_step(step, device, backend)
        self.sizes: set[int] = set()  # block sizes compiled so far
        self.write_at = write_at
        self.compiled_causal = compile_step(self._causal_step, device, backend) if write_at is not None else None
        self.causal_sizes: set[int] = set()

    def _causal_step(self, hidden: torch.Tensor, tokens: torch.Tensor):
        m = tokens.shape[1]
        positions = self.write_at + torch.arange(m, device=tokens.device)
        return self.step(hidden, tokens, positions.view(1, m), causal_allowed(positions, self.max_len))

    def causal(self, hidden: torch.Tensor, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """A chain block of n tokens at slots [start, start + n), the write slot pointed at ``start``; compiled at n
        itself, never padded (a graph per size: a commit's step reads the block's last row, which padding would move).
        Returns the step's output(s)."""
        n = tokens.shape[1]
        if self.compiled_causal is None or start == 0 or n > COMPILED_BLOCK:  # eager, with the mask made here
            positions = torch.arange(start, start + n, device=self.device)
            return self(hidden, tokens, positions, causal_allowed(positions, start + n), start)
        if start + n > self.max_len:
            raise ValueError(f"draft KV cache overflow: {start + n} > max_len {self.max_len} (raise --max-len)")
        # Fresh strides: a slice of a longer block (the last output of a commit) would recompile the graph.
        hidden, tokens = (t.clone(memory_format=torch.contiguous_format) for t in (hidden, tokens))
        self.causal_sizes.add(n)
        if self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        return self._rows(self.compiled_causal(hidden, tokens), n)

    def _rows(self, out, n: int):
        """The block's rows of each output; on a GPU copied out, since a CUDA graph's replay overwrites its outputs."""
        cut = lambda t: t[:, :n].clone() if self.device.type == "cuda" else t[:, :n]  # noqa: E731
        return tuple(map(cut, out)) if isinstance(out, tuple) else cut(out)

    def __call__(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
                 start: int) -> torch.Tensor:
        """n tokens at slots [start, start + n): hidden [1, n, W], tokens [1, n], positions [n], allowed [n, start + n].
        The caller has pointed its cache's write slot at ``start``. Returns the step's output(s), n rows each."""
        n = tokens.shape[1]
        eager = start == 0 or n > COMPILED_BLOCK
        m = n if eager else padded_size(self.sizes, n, self.max_len - start)
        if start + m > self.max_len:
            raise ValueError(f"draft KV cache overflow: {start + m} > max_len {self.max_len} (raise --max-len)")
        full = torch.zeros(m, self.max_len, dtype=torch.bool, device=self.device)  # the step attends to every slot
        full[:n, : start + n] = allowed
        if eager:
            return self.step(hidden, tokens, positions.view(1, n), full)  # n = m: every row is the block's
        pad = torch.arange(n, m, device=self.device)
        full[pad, start + pad] = True  # a padding token sees only its own slot
        if m > n:
            hidden = torch.cat([hidden, hidden.new_zeros(1, m - n, hidden.shape[-1])], dim=1)
            tokens = torch.cat([tokens, tokens.new_zeros(1, m - n)], dim=1)
            positions = torch.cat([positions, positions[-1:].expand(m - n)])
        # Fresh strides: a slice of a longer block (the last output of a commit) would recompile the graph.
        hidden, tokens, positions = (t.clone(memory_format=torch.contiguous_format) for t in (hidden, tokens, positions))
        self.sizes.add(m)
        if self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        return self._rows(self.compiled(hidden, tokens, positions.view(1, m), full), n)

    def precompile(self, max_block: int, width: int, dtype: torch.dtype, masked: bool = True) -> None:
        """Compile every block size 1..``max_block`` now (a benchmark's timed rounds then never compile), on dummy
        pairs written from the caller's write slot: point it at 0 before any prompt, whose ``begin`` overwrites them.
        ``width``: the last dimension of the step's ``hidden`` input. Causal blocks when built with ``write_at``;
        ``masked``: the masked ones too (trees)."""
        for m in range(1, min(max_block, COMPILED_BLOCK, self.max_len) + 1):
            hidden = torch.zeros(1, m, width, dtype=dtype, device=self.device)
            tokens = torch.zeros(1, m, dtype=torch.long, device=self.device)
            if self.compiled_causal is not None and m not in self.causal_sizes:
                if self.device.type == "cuda":
                    torch.compiler.cudagraph_mark_step_begin()
                self.compiled_causal(hidden, tokens)
                self.causal_sizes.add(m)
            if masked and m not in self.sizes:
                if self.device.type == "cuda":
                    torch.compiler.cudagraph_mark_step_begin()
                self.compiled(hidden, tokens, torch.arange(m, device=self.device).view(1, m),
                              self_mask(m, self.max_len, self.device))
                self.sizes.add(m)


class ChainGraph:
    """A drafter's greedy chain compiled as one graph: ``chain(hidden [1, 1, H], logits, steps) -> [steps]`` draft ids,
    the k steps with their logits and argmax unrolled (a step compiled alone is a replay plus ~25 eager ops around it,
    and on a GPU those launches were the draft's cost). One graph for the longest k met: a shorter budget (the last
    rounds) takes a prefix, its extra speculative slots overwritten by the next commit like every draft slot."""

    def __init__(self, chain: Callable, max_len: int, device: torch.device, backend: str = "inductor") -> None:
        self.compiled = compile_step(chain, device, backend)
        self.max_len = max_len
        self.device = device
        self.steps = 0  # the chain length compiled so far

    def fits(self, length: int, k: int) -> bool:
        """Whether k drafts after ``length`` committed slots stay inside the cache (else the caller steps eagerly)."""
        return 0 < k and length + k <= self.max_len

    def __call__(self, hidden: torch.Tensor, logits: torch.Tensor, k: int, length: int) -> torch.Tensor:
        """k draft ids from the last committed output; the caller has pointed its write slot at ``length`` - 1."""
        steps = max(k, self.steps) if length + self.steps <= self.max_len else k
        self.steps = max(steps, self.steps)
        if self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        # Fresh strides: the last committed output is a slice of the commit's block (its strides would recompile).
        hidden, logits = (t.clone(memory_format=torch.contiguous_format) for t in (hidden, logits))
        return self.compiled(hidden, logits, steps)[:k].clone()


class TreeGraph:
    """A drafter's whole dynamic (EAGLE-2) tree compiled as one graph: ``grow(hidden [1, 1, H], logits, depth, topk,
    total)`` -> the kept nodes' target ids, parents, levels and verify mask (decode/tree.py ``grow_static_tree``). Level
    by level a tree dispatched ~280 eager ops around its step graphs (its top-ks, ancestor masks, re-ranking): 6.6 ms
    a round on the H200 against 0.3 ms for a one-graph chain. One graph per tree shape."""

    def __init__(self, grow: Callable, max_len: int, device: torch.device, backend: str = "inductor") -> None:
        self.compiled = compile_step(grow, device, backend)
        self.max_len = max_len
        self.device = device

    def __call__(self, hidden: torch.Tensor, logits: torch.Tensor, depth: int, topk: int, total: int, length: int
                 ) -> tuple[torch.Tensor, ...] | None:
        """The tree after ``length`` committed slots, or None when it cannot be one graph (a single level, more
        children than the vocab, nodes past the cache's end: the level-by-level form then runs, or refuses by name)."""
        if depth < 2 or topk > logits.shape[-1] or length + topk * (depth - 1) > self.max_len:
            return None
        if self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        # Fresh strides: the last committed output is a slice of the commit's block (its strides would recompile).
        hidden, logits = (t.clone(memory_format=torch.contiguous_format) for t in (hidden, logits))
        return tuple(t.clone() for t in self.compiled(hidden, logits, depth, topk, total))
