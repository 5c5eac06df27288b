"""Run the target over new tokens against a ``PositionalKVCache`` (batch size 1), or a batch of chains of
different lengths against a ``StaticRaggedKVCache`` (``RaggedRunner``).

``forward`` scores a block of n new tokens placed after the committed cache: a chain (causal) or a
tree (``tree_mask[i, j]``: token i may attend to token j, its ancestors and itself; position ids by
depth). It returns full-vocab logits for the n positions only and the target's states there (aux
hidden states for EAGLE-3, the final hidden state for Medusa and MTP), which drafters read. The
block is written to the cache but not committed: the caller keeps what was accepted (``commit`` for
a chain prefix, ``cache.keep`` for a tree path) and the rest is simply overwritten.
"""

from __future__ import annotations

from typing import Iterable

import torch

from headstart.decode.clock import median_seconds
from headstart.decode.kv_cache import PositionalKVCache, StaticKVCache, move_slots
from headstart.decode.ragged_blocks import RaggedBlocks
from headstart.decode.static_blocks import COMPILED_BLOCK, causal_allowed, compile_step, padded_size, self_mask
from headstart.models.target import Target, TargetOutput, additive_mask, decoder_layers


def pad_sizes(cost: dict[int, float], margin: float = 0.05) -> dict[int, int]:
    """{n: the size a block of n tokens runs at} from measured block costs {n: seconds}: the cheapest size >= n, where
    it is cheaper than n by more than ``margin`` (timing noise must not pad a block for nothing), else n."""
    pads = {}
    for n in cost:
        best = min((m for m in cost if m >= n), key=cost.__getitem__)
        pads[n] = best if cost[best] < (1 - margin) * cost[n] else n
    return pads


def in_place_prefix(path: list[int]) -> int:
    """How many leading nodes of a tree's accepted ``path`` (block indices, root first) already sit where keeping the
    path puts them (node i at block index i): those are committed as they are, the rest move."""
    return next((i for i, index in enumerate(path) if index != i), len(path))


class TargetRunner:
    def __init__(self, target: Target, max_len: int, with_aux: bool = True, compile: bool = False,
                 backend: str = "inductor") -> None:
        """``with_aux``: whether drafters read the aux hidden states (EAGLE-3); others skip building them.
        ``compile``: the decode forward through ``torch.compile(backend=backend)`` over a static cache
        (``StaticKVCache``: every forward attends over all ``max_len`` slots, so keep ``max_len`` near what a
        generation needs), with CUDA graphs on a GPU."""
        self.target = target
        self.max_len = max_len
        self.with_aux = with_aux
        self.device = next(target.model.parameters()).device
        self.cache = StaticKVCache(target.num_layers, max_len, self.device) if compile else \
            PositionalKVCache(target.num_layers, max_len)
        # Two kinds of compiled block: a causal one (plain decoding's token, a chain's verify, a draft model's chain
        # step), whose mask and positions the graph builds from the cache's write slot -- no eager kernels around it
        # -- and a masked one (trees: a mask, depths and visible slots made by the caller).
        self._compiled = compile_step(self._run, self.device, backend) if compile else None
        if compile:  # a tree's accepted path moved in one call, not ~4 ops a layer; one graph for every path length
            self.cache.mover = compile_step(move_slots, self.device, backend, dynamic=True)
        self._causal = compile_step(self._run_causal, self.device, backend) if compile else None
        self._sizes: set[int] = set()  # masked block sizes compiled so far
        self._causal_sizes: set[int] = set()
        self._pad_to: dict[int, int] = {}  # eager causal blocks: n tokens run padded to this size (tune_blocks)
        self.block_costs: dict[int, float] = {}  # what tune_blocks measured: seconds of a block of n tokens
        self._dtype = next(target.model.parameters()).dtype
        # Sliding-window attention (Gemma 2/3, Mistral, Qwen with use_sliding_window): those layers see only
        # keys less than ``window`` positions back. The mask is explicit here, so the window must be in it.
        config = target.config.get_text_config()
        self.window = getattr(config, "sliding_window", None)
        types = getattr(config, "layer_types", None)
        if types is None:  # no per-layer types: a window, when set, applies to every layer (Mistral)
            types = ["sliding_attention" if self.window else "full_attention"] * target.num_layers
        self.layer_types = set(types) if self.window else {"full_attention"}

    @property
    def length(self) -> int:
        return self.cache.length

    def reset(self) -> None:
        self.cache.rollback(0)

    def commit(self, n: int) -> None:
        """Keep the first n tokens of the last block (a chain's accepted prefix)."""
        self.cache.rollback(self.cache.length + n)

    def keep(self, path: list[int]) -> None:
        """Keep the tokens at block indices ``path`` (a tree's accepted path, root first). The leading run already in
        place (the root, and any node right after its parent in the block) is committed as it is; the rest move."""
        in_place = in_place_prefix(path)
        self.cache.rollback(self.cache.length + in_place)
        if in_place < len(path):
            self.cache.keep(self.cache.length - in_place + torch.tensor(path[in_place:], device=self.cache.device))

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [1, n]
        tree_mask: torch.Tensor | None = None,  # [n, n] bool, True = may attend
        depths: torch.Tensor | None = None,  # [n] position offset of each token (tree depth)
        start: int | None = None,
        visible: torch.Tensor | None = None,  # [n, start] bool: the earlier slots each new token sees
        last_only: bool = False,
    ) -> tuple[torch.Tensor, TargetOutput]:
        """-> (logits [1, n, V], the target's states [1, n, ...]) for the n new tokens.

        ``start``: the block's first slot (default: right after the committed tokens). A drafter running this
        runner over its own small model writes its speculative steps further on, and its tree nodes see only their
        ancestors among the earlier ones (``visible``; default: every slot before ``start``). ``last_only``: logits
        [1, 1, V] at the last token only (a prompt needs no more)."""
        n = input_ids.shape[1]
        start = self.cache.length if start is None else start
        device = input_ids.device
        compiled = self._compiled is not None and start > 0 and n <= COMPILED_BLOCK
        if compiled and tree_mask is None and depths is None and visible is None:
            return self._forward_causal(input_ids, start, last_only)
        # A compiled block is padded (``padded_size``); padding attends only to itself and is never attended to, and
        # its cache slots lie past the committed length.
        if compiled:
            m = padded_size(self._sizes, n, self.max_len - start)
        elif (tree_mask is None and depths is None and visible is None and not last_only
              and start + self._pad_to.get(n, n) <= self.max_len):
            m = self._pad_to.get(n, n)  # a causal block padded to a cheaper size (tune_blocks); not a last-only read,
            # whose one row of logits would be the last padding token's
        else:
            m = n
        if start + m > self.max_len:
            raise ValueError(f"KV cache overflow: {start + m} tokens > max_len {self.max_len} (raise --max-len)")
        keys = self.max_len if self._compiled is not None else start + m  # a static cache: every slot, the rest masked
        within = torch.eye(m, dtype=torch.bool, device=device)
        within[:n, :n] = torch.ones(n, n, dtype=torch.bool, device=device).tril() if tree_mask is None else tree_mask
        allowed = torch.zeros(m, keys, dtype=torch.bool, device=device)
        allowed[:, :start] = True
        if visible is not None:
            allowed[:n, :start] = visible
        allowed[:, start : start + m] = within  # [m, keys]
        offsets = torch.arange(m, device=device)
        if depths is not None:
            offsets[:n] = depths
        position_ids = (start + offsets).unsqueeze(0)
        key_pos = torch.arange(keys, device=device)
        key_pos[start : start + m] = position_ids[0]  # a block's key sits at its query's position (a tree's depth)
        mask = self._mask(allowed, position_ids[0], key_pos)
        if m > n:
            input_ids = torch.cat([input_ids, input_ids.new_zeros(1, m - n)], dim=1)
        self.cache.begin(start)
        if compiled:
            self._sizes.add(m)
            if device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()
            out = self._compiled(input_ids, mask, position_ids)
        else:
            out = self._run(input_ids, mask, position_ids, last_only)
        return self._outputs(out, n, compiled, last_only)

    @torch.no_grad()
    def forward_layers(self, input_ids: torch.Tensor, layers: int, start: int | None = None) -> torch.Tensor:
        """The target's first ``layers`` decoder layers over a causal block [1, n] at slot ``start`` (default: right
        after the committed tokens) -> the hidden state after the last of them [1, n, H] (before any final norm).

        Those layers' K/V go to the cache's slots there, uncommitted, and every earlier slot is visible: a
        self-speculative drafter (early exit) drafts on the target's own cache, reading the committed context's
        first-layer K/V that verification wrote and writing its drafts' where verification overwrites them. Eager
        runners only (a compiled runner's graphs run every layer)."""
        if self._compiled is not None:
            raise ValueError("forward_layers runs on an eager runner (compile=False)")
        total = len(decoder_layers(self.target.model))
        if not 0 < layers <= total:
            raise ValueError(f"forward_layers: layers must be in 1..{total}, got {layers}")
        mask, positions = self._causal_block(input_ids.shape[1], start, input_ids.device)
        return self.target.first_layers(input_ids, layers, mask, positions, self.cache)

    @torch.no_grad()
    def forward_skipping(self, input_ids: torch.Tensor, skip: frozenset[int], start: int | None = None) -> torch.Tensor:
        """The target without its decoder layers ``skip`` over a causal block [1, n] at slot ``start`` (default: right
        after the committed tokens) -> logits [1, n, V]. The layers run write their K/V there, uncommitted, where the
        full forward verifying the drafts overwrites them (Draft & Verify). Eager runners only."""
        if self._compiled is not None:
            raise ValueError("forward_skipping runs on an eager runner (compile=False)")
        mask, positions = self._causal_block(input_ids.shape[1], start, input_ids.device)
        return self.target.logits(self.target.skipping_layers(input_ids, skip, mask, positions, self.cache))

    @torch.no_grad()
    def forward_from(self, hidden: torch.Tensor, layer: int, start: int | None = None) -> tuple[torch.Tensor, TargetOutput]:
        """The target's layers from ``layer`` on over a causal block at slot ``start`` (default: right after the
        committed tokens), given the hidden state entering that layer [1, n, H] (``forward_layers(ids, layer)``'s)
        -> (logits [1, n, V], the final hidden state; no aux states). The block's first layers' K/V must already be
        in the cache's slots there: self-speculation verifies its drafts without running those layers again."""
        if self._compiled is not None:
            raise ValueError("forward_from runs on an eager runner (compile=False)")
        if self.with_aux:
            raise ValueError("forward_from gives no aux hidden states: build the runner with with_aux=False")
        mask, positions = self._causal_block(hidden.shape[1], start, hidden.device)
        last = self.target.layers_from(hidden, layer, mask, positions, self.cache)
        return self.target.logits(last), TargetOutput(aux_hidden_states=None, last_hidden_state=last)

    def _causal_block(self, n: int, start: int | None, device: torch.device) -> tuple[object, torch.Tensor]:
        """An eager causal block of n tokens at slot ``start`` (default: right after the committed tokens), every
        earlier slot visible: (its mask, positions [1, n]); the cache is set to write there."""
        start = self.cache.length if start is None else start
        if start + n > self.max_len:
            raise ValueError(f"KV cache overflow: {start + n} tokens > max_len {self.max_len} (raise --max-len)")
        allowed = torch.ones(n, start + n, dtype=torch.bool, device=device)
        allowed[:, start:] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        positions = start + torch.arange(n, device=device)
        self.cache.begin(start)
        return self._mask(allowed, positions, torch.arange(start + n, device=device)), positions.unsqueeze(0)

    def _forward_causal(self, input_ids: torch.Tensor, start: int, last_only: bool) -> tuple[torch.Tensor, TargetOutput]:
        """A compiled causal block at ``start``: padded to a compiled size; the graph reads the start from the cache's
        write slot. Padding tokens attend causally too: nothing attends to them and their slots lie past the block."""
        n = input_ids.shape[1]
        m = padded_size(self._causal_sizes, n, self.max_len - start)
        if start + m > self.max_len:
            raise ValueError(f"KV cache overflow: {start + m} tokens > max_len {self.max_len} (raise --max-len)")
        if m > n:
            input_ids = torch.cat([input_ids, input_ids.new_zeros(1, m - n)], dim=1)
        self.cache.begin(start)
        self._causal_sizes.add(m)
        if self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        return self._outputs(self._causal(input_ids), n, True, last_only)

    def _outputs(self, out: tuple, n: int, compiled: bool, last_only: bool) -> tuple[torch.Tensor, TargetOutput]:
        """The block's n rows of (logits, aux, last), copied out of a CUDA graph's buffers."""
        if out[0].shape[1] > n:
            out = tuple(t if t is None else t[:, :n] for t in out)
        if compiled and self.device.type == "cuda":  # a CUDA graph's outputs are overwritten by its next replay
            out = tuple(t if t is None else t.clone() for t in out)
        logits, aux, last = out
        if last_only:
            logits = logits[:, -1:]
        return logits, TargetOutput(aux_hidden_states=aux, last_hidden_state=last)

    @torch.no_grad()
    def time_blocks(self, max_block: int, context: int = 256, repeats: int = 5) -> dict[int, float]:
        """Median seconds of this runner's forward over a causal block of n = 1..``max_block`` tokens after ``context``
        dummy ones (as they run now: padded where ``tune_blocks`` set it). Resets the cache: call it before a prompt."""
        if context + max_block > self.max_len:
            raise ValueError(f"timing blocks needs {context + max_block} slots; the cache holds {self.max_len}")
        self.reset()
        ids = torch.full((1, context + max_block), 1, dtype=torch.long, device=self.device)
        self.forward(ids[:, :context], last_only=True)
        self.commit(context)
        cost = {n: median_seconds(lambda n=n: self.forward(ids[:, :n]), repeats, self.device)
                for n in range(1, max_block + 1)}
        self.reset()
        return cost

    def tune_blocks(self, max_block: int, context: int = 256, repeats: int = 5) -> dict[int, int]:
        """Eager runner: time causal blocks of 1..``max_block`` tokens (``time_blocks``) and from now on run a block of
        n tokens padded to the cheapest size >= n. Why: a CPU BLAS may multiply 2 or 3 rows as 2 or 3 matrix-vector
        products (fp32 on this project's 2-core CPU: a 3-token SmolLM2 forward 125 ms, a 5-token one 87 ms), so a
        chain cut short or a short n-gram match would cost more than a full block. Call it before a prompt (it resets
        the cache). Returns {n: the size n runs at}; ``block_costs`` keeps the seconds measured."""
        if self._compiled is not None:
            raise ValueError("tune_blocks is for an eager runner: a compiled one pads to its compiled sizes")
        self._pad_to = {}
        self.block_costs = self.time_blocks(max_block, context, repeats)
        self._pad_to = pad_sizes(self.block_costs)
        return dict(self._pad_to)

    @torch.no_grad()
    def precompile(self, sizes: Iterable[int], masked: Iterable[int] = (), keeps: bool = False) -> None:
        """With ``compile``: compile the forward for causal blocks of ``sizes`` (plain decoding, chains) and masked
        blocks of ``masked`` (trees) now, on dummy tokens at slot 0 (call it before a prompt, whose forward
        overwrites them), so no block compiles mid-generation: a block then runs the smallest compiled size of its
        kind that holds it (a 30-layer target's graph takes ~30 s to compile on a CPU). ``keeps``: also the cache's
        move of a tree's accepted path (the target's; a draft model's runner never keeps a path)."""
        if self._compiled is None:
            return
        if self.cache.length:
            raise RuntimeError("precompile writes dummy tokens from slot 0: call it before a prompt, not mid-generation")
        sizes, masked = set(sizes), set(masked)
        self._allocate()
        fits = lambda m, done: m not in done and 0 < m <= min(COMPILED_BLOCK, self.max_len)  # noqa: E731
        for m in sorted(m for m in sizes if fits(m, self._causal_sizes)):
            self.cache.begin(0)
            if self.device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()
            self._causal(torch.zeros(1, m, dtype=torch.long, device=self.device))
            self._causal_sizes.add(m)
        for m in sorted(m for m in masked if fits(m, self._sizes)):
            slots = torch.arange(m, device=self.device)
            self.cache.begin(0)
            if self.device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()
            mask = self._mask(self_mask(m, self.max_len, self.device), slots, torch.arange(self.max_len, device=self.device))
            self._compiled(torch.zeros(1, m, dtype=torch.long, device=self.device), mask, slots.view(1, m))
            self._sizes.add(m)
        if keeps:  # a tree's accepted path: the move of one slot and of several (dummy slots, as above)
            for m in (1, 2):
                self.cache.keep(torch.zeros(m, dtype=torch.long, device=self.device))
        self.cache.rollback(0)

    def _allocate(self) -> None:
        """Allocate the static cache with one eager token at slot 0: its buffers are then created outside a compiled
        graph, with the fixed addresses CUDA graphs need (inside one, ``mark_static_address`` cannot run)."""
        slot = torch.zeros(1, dtype=torch.long, device=self.device)
        self.cache.begin(0)
        mask = self._mask(self_mask(1, self.max_len, self.device), slot, torch.arange(self.max_len, device=self.device))
        self._run(slot.view(1, 1), mask, slot.view(1, 1))

    def _run(self, input_ids: torch.Tensor, mask, position_ids: torch.Tensor, last_only: bool = False):
        """The target over a block, written to the cache: (logits, aux states or None, final hidden state)."""
        out = self.target(input_ids, attention_mask=mask, position_ids=position_ids, past_key_values=self.cache,
                          with_aux=self.with_aux)
        last = out.last_hidden_state
        return self.target.logits(last[:, -1:] if last_only else last), out.aux_hidden_states, last

    def _run_causal(self, input_ids: torch.Tensor):
        """``_run`` over a causal block at the cache's write slot, its mask and positions built in the graph: token i
        at position start + i sees every slot up to its own."""
        m = input_ids.shape[1]
        positions = self.cache.write_at + torch.arange(m, device=input_ids.device)
        keys = torch.arange(self.max_len, device=input_ids.device)
        mask = self._mask(causal_allowed(positions, self.max_len), positions, keys)
        return self._run(input_ids, mask, positions.unsqueeze(0))

    def _mask(self, allowed: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor):
        """The additive mask for every layer, or a {layer type: mask} dict (what HF models with
        ``layer_types`` take) when sliding and full attention layers are mixed. ``allowed`` [(B,) n, S], the
        positions of the queries [(B,) n] and of the keys [(B,) S] (a committed key at its own position, a tree's
        at its depth's)."""
        full = additive_mask(allowed, self._dtype)
        if "sliding_attention" not in self.layer_types:
            return full
        in_window = (query_pos[..., :, None] - key_pos[..., None, :]) < self.window  # HF: kv_idx > q_idx - window
        sliding = additive_mask(allowed & in_window, self._dtype)
        if self.layer_types == {"sliding_attention"}:
            return sliding
        return {"full_attention": full, "sliding_attention": sliding}


class RaggedRunner(TargetRunner):
    """The target over a batch of sequences of different lengths, through ``RaggedBlocks`` (decode/ragged_blocks.py).

    ``forward`` scores a chain block [B, n] placed after each row's own committed tokens; row b's tokens past
    ``valid[b]`` are padding (a shorter prompt, a shorter draft) that no real token attends to. Rotary positions
    are per row, so a row's logits are the ones it would get decoded alone.

    ``compile``: blocks after the prompts run through ``torch.compile`` (CUDA graphs on a GPU) as ``RaggedBlocks``
    (decode/ragged_blocks.py) over a ``StaticRaggedKVCache``: padded to a compiled width, their mask and positions built
    inside the graph from the rows' write slots, attending over a key window of 128, 256, ... slots (a graph each),
    not all ``max_len``. The batch keeps its size to the end: a finished row stays as a dead row (the graph's shapes
    do not change, so nothing recompiles), at the cost of computing it; prompts run eagerly on the same cache."""

    def __init__(self, target: Target, max_len: int, with_aux: bool = True, compile: bool = False,
                 backend: str = "inductor") -> None:
        super().__init__(target, max_len, with_aux)
        self._blocks = RaggedBlocks(self._step, max_len, self.device, compile=compile, backend=backend,
                                    num_layers=target.num_layers, name="target")
        self.cache = self._blocks.cache

    @property
    def length(self) -> int:
        return max(self.cache.lengths, default=0)

    def reset(self, batch: int = 1) -> None:
        self.cache.reset(batch)

    def commit(self, counts: list[int]) -> None:
        self.cache.commit(counts)

    def select(self, rows: list[int]) -> None:
        self.cache.select(rows)

    def keep(self, path: list[int]) -> None:
        raise NotImplementedError("a ragged batch decodes chains; trees run one sequence at a time (TargetRunner)")

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, valid: list[int] | None = None, starts: list[int] | None = None,
                last_only: bool = False) -> tuple[torch.Tensor, TargetOutput]:
        """input_ids [B, n], ``valid[b]`` real tokens in row b (default n) -> (logits [B, n, V], states [B, n, ...]).
        ``starts[b]``: row b's first slot (default its committed length; a drafter's later chain steps go after its
        earlier uncommitted ones, which they attend to). ``last_only``: logits [B, V] at each row's last real token
        only (a prompt needs no more, and [B, T, V] for a long prompt and a large vocab is gigabytes)."""
        B, n = input_ids.shape
        valid = valid or [n] * B
        last, aux = self._blocks(None, input_ids, self.cache.lengths if starts is None else starts, valid)
        states = TargetOutput(aux_hidden_states=aux, last_hidden_state=last)
        return self._last_logits(last, valid) if last_only else self.target.logits(last), states

    def _last_logits(self, hidden: torch.Tensor, valid: list[int]) -> torch.Tensor:
        """Logits [B, V] at each row's last real token."""
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return self.target.logits(hidden[rows, torch.tensor(valid, device=hidden.device) - 1])

    @torch.no_grad()
    def precompile_batch(self, batch: int, sizes: Iterable[int]) -> None:
        """With ``compile``: compile the forward of ``batch`` rows for blocks of ``sizes`` tokens now (plain decoding's
        1, a chain's k + 1), so no width compiles mid-generation. Leaves the cache reset to ``batch`` empty rows."""
        self._blocks.precompile(batch, sizes)

    def _step(self, hidden: torch.Tensor | None, input_ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor, cache):
        """``RaggedBlocks``' step: the target over a [B, m] block -> (final hidden state, aux states or None). The logits
        are left out of the graph: a prompt needs only its rows' last ones, [B, T, V] for a long prompt is gigabytes."""
        mask = self._mask(allowed, positions, torch.arange(allowed.shape[-1], device=input_ids.device))
        out = self.target(input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                          with_aux=self.with_aux)
        return out.last_hidden_state, out.aux_hidden_states
