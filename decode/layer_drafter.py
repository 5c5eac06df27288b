"""A draft of one decoder layer (or a few) over its own KV cache, fed back its own output: what EAGLE-3 and MTP draft
with (and P-EAGLE, on EAGLE-3's), for one sequence or a batch.

Draft pair j is (an input read from the target's states at j, token x_{j+1}) at rotary position j; committed pairs
live in the draft's cache (a layer for each of its decoder layers, all written at the same slots). To draft k tokens
from the last committed pair, step i (i >= 1) feeds back the
layer's previous output with the token just drafted, one position further, attending to the committed keys and its own
earlier steps -- the attention pattern and positions of the head's training step i (EAGLE-3's training-time test, MTP's
unroll). Trees expand top-k children the same way, each node attending to the committed context, its expanded
ancestors and itself.

Both paths run the head's draft step (``layer``: its one decoder layer, or its stack) over a cache of their own:
- one sequence (``begin``/``propose``/``update`` and the tree methods: decode/generate.py's loops) on a one-row
  ``PositionalKVCache``, or with ``compile`` a ``StaticKVCache`` whose compiled forms are a step (decode/static_blocks.py
  ``StaticBlocks``), a commit, a whole greedy chain (``ChainGraph``) and a whole dynamic tree (``TreeGraph``);
- a batch of any size, 1 included (``begin_batch``/``propose_batch``/``update_batch``/``select``:
  decode/batch_generate.py's loop), on a ragged cache (decode/ragged_blocks.py): row b's committed length its own, its
  padding attending only to itself, its speculative slots overwritten by its next commit.
The one-sequence path serves batch 1: trees, ``--confidence-threshold`` and the compiled whole-chain and whole-tree
graphs exist there only.

The cache is an HF ``Cache`` (MTP's layer is a transformers decoder layer, which writes its keys through
``Cache.update``); EAGLE-3's step takes an attention callback, which writes through the same ``update``. Its
arithmetic is what EAGLE-3's own key/value tensors did -- eagerly, slots [start, end) written and [0, end) read;
compiled, ``index_copy_`` at the write slot and every slot read under the mask -- so both heads decode bit for bit as
before, and one cache serves both paths' compiled graphs.
"""

from __future__ import annotations

import torch

from headstart.decode.batch_generate import padded_rows, shifted_prompts
from headstart.decode.chain import ChainRows
from headstart.decode.kv_cache import PositionalKVCache, StaticKVCache, static_address
from headstart.decode.ragged_blocks import RaggedBlocks
from headstart.decode.static_blocks import ChainGraph, StaticBlocks, TreeGraph, causal_allowed, self_mask
from headstart.decode.tree import DynamicTree, ExpandedNodes, grow_static_tree
from headstart.models.target import TargetOutput


class LayerDrafter(ChainRows):
    """A head's drafter supplies its ``layer``, its ``_logits``, what a commit reads (``commit_input``, ``project``),
    and sets ``head``, ``hidden_size`` (the layer's width), ``input_width`` (a commit input's), ``dtype``,
    ``target_vocab_size`` before calling ``__init__`` here."""

    hidden_size: int
    input_width: int
    dtype: torch.dtype
    num_layers: int = 1
    """The draft's decoder layers: its caches hold a layer each, every layer written at the same slots."""

    def __init__(self, max_len: int, device: torch.device, compile: bool = False, backend: str = "inductor") -> None:
        """``compile``: the layer's step through ``torch.compile`` at static shapes (decode/static_blocks.py and, for a
        batch, decode/ragged_blocks.py), CUDA graphs on a GPU; build one drafter and reuse it for every prompt or batch
        (``begin``/``begin_batch`` start afresh), so it compiles once."""
        self.max_len, self.device, self.compile, self.backend = max_len, device, compile, backend
        self.cache = (StaticKVCache(self.num_layers, max_len, device) if compile
                      else PositionalKVCache(self.num_layers, max_len))
        self._committed = torch.zeros((), dtype=torch.long, device=device)  # the committed slots, for the tree graph
        self._blocks = self._commits = self._chain = self._tree = None
        if compile:
            static_address(self._committed)
            self._blocks = StaticBlocks(self._static_step, max_len, device, backend)  # tree levels, unsure chains
            # A commit (the step and its logits) as one graph per block size, its chain mask built in the graph: the
            # update read 1.2 ms a round on the H200 around a compiled step of a fraction of that.
            self._commits = StaticBlocks(self._static_commit, max_len, device, backend, write_at=self.cache.write_at)
            self._chain = ChainGraph(self._static_chain, max_len, device, backend)  # compiled at its first round
            self._tree = TreeGraph(self._static_tree, max_len, device, backend)  # a dynamic tree as one graph
        self._rows: RaggedBlocks | None = None  # the batch path's ragged cache, built at its first batch
        self.last_hidden: torch.Tensor | None = None  # [1, 1, H] the layer's output at the last committed pair
        self.next_logits: torch.Tensor | None = None  # [V'] the logits after it: a chain's first draft, a tree's root
        self.confidence_threshold = 0.0  # > 0: a chain stops after a draft it is less sure of (decode/confidence.py)
        self.rows_hidden: torch.Tensor | None = None  # [B, 1, H] a batch's output at each row's last committed pair
        self.rows_logits: torch.Tensor | None = None  # [B, V']

    # -- what a head supplies -------------------------------------------------------------------------
    def layer(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
              cache) -> torch.Tensor:
        """The draft layer on pairs (hidden [B, n, H], tokens [B, n] as target ids) at rotary ``positions`` [B, n],
        attending under ``allowed`` ([n, S] one sequence, [B, n, S] a batch) to the keys ``cache.update`` returns
        (this block's written from the cache's write slot) -> the outputs [B, n, H] the next step reads."""
        raise NotImplementedError

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's outputs [..., H] -> logits over the draft vocab [..., V']."""
        raise NotImplementedError

    def commit_input(self, states: TargetOutput) -> torch.Tensor:
        """What a commit reads of the target's states [B, n, ...] ([B, n, input_width])."""
        raise NotImplementedError

    def project(self, inputs: torch.Tensor) -> torch.Tensor:
        """A commit's inputs -> the layer's hidden input [B, n, H] (EAGLE-3's ``fc``); default: as they are."""
        return inputs

    @property
    def last_logits(self) -> torch.Tensor:
        return self.next_logits

    @property
    def length(self) -> int:
        """Committed draft positions."""
        return self.cache.length

    @property
    def keys(self) -> torch.Tensor:
        """The layer's cached keys [1, heads, max_len, head_dim] (allocated at its first step)."""
        return self.cache.layers[0].keys

    # -- one sequence ---------------------------------------------------------------------------------
    @torch.no_grad()
    def precompile(self, max_block: int, trees: bool = True) -> None:
        """With ``compile``: compile the commit for every block of up to ``max_block`` pairs now (before a prompt),
        and with ``trees`` the masked step (tree levels, chains a threshold stops) too."""
        if self._blocks is None:
            return
        if self.cache.length:
            raise RuntimeError("precompile writes dummy pairs from slot 0: call it before a prompt")
        self.cache.begin(0)
        # the static cache allocated eagerly: outside a compiled graph its buffers get fixed addresses
        zeros = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self._static_step(torch.zeros(1, 1, self.hidden_size, dtype=self.dtype, device=self.device), zeros, zeros,
                          self_mask(1, self.max_len, self.device))
        if trees:
            self._blocks.precompile(max_block, self.hidden_size, self.dtype)
        self._commits.precompile(max_block, self.input_width, self.dtype, masked=False)

    @torch.no_grad()
    def _step(self, hidden: torch.Tensor, tokens: torch.Tensor, start: int, positions: torch.Tensor | None = None,
              allowed: torch.Tensor | None = None) -> torch.Tensor:
        """The layer on n pairs (hidden [1, n, H], tokens [1, n]) written at slots [start, start+n). Defaults: slot s at
        rotary position s and causal attention over every earlier slot; a tree passes its own ``positions`` [n] and
        ``allowed`` [n, start+n]. Returns the outputs [1, n, H]."""
        n = tokens.shape[1]
        end = start + n
        if end > self.max_len:
            raise ValueError(f"draft KV cache overflow: {end} > max_len {self.max_len}")
        if positions is None:
            positions = torch.arange(start, end, device=self.device)
        if allowed is None:
            allowed = causal_allowed(torch.arange(start, end, device=self.device), end)
        self.cache.begin(start)
        if self._blocks is not None:
            return self._blocks(hidden, tokens, positions, allowed, start)
        return self._static_step(hidden, tokens, positions.view(1, n), allowed)

    def _static_step(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                     allowed: torch.Tensor) -> torch.Tensor:
        """The layer on pairs at rotary ``positions`` [1, m] under ``allowed`` [m, keys] (keys: every static slot when
        compiled), written to the cache from its ``begin`` slot."""
        return self.layer(hidden, tokens, positions, allowed, self.cache)

    def _static_commit(self, inputs: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                       allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``_commit``'s arithmetic at static shapes: (the layer's outputs [1, m, H], the logits after the last of them
        [1, 1, V']: the only ones a commit reads)."""
        out = self._static_step(self.project(inputs), tokens, positions, allowed)
        return out, self._logits(out[:, -1:])

    def _static_chain(self, hidden: torch.Tensor, logits: torch.Tensor, steps: int) -> torch.Tensor:
        """``propose`` at static shapes: ``steps`` greedy drafts (target ids) from the last committed output (hidden
        [1, 1, H], logits [V']), the cache's write slot pointing at the last committed pair; step i writes the next
        slot, at that rotary position, attending to every slot up to it -- ``_step``'s defaults for one pair."""
        token = self.to_target(logits.argmax(-1).view(1))
        drafted = [token]
        for _ in range(1, steps):
            self.cache.write_at.add_(1)  # the slot after the previous step's
            position = self.cache.write_at.clone().view(1, 1)
            hidden = self._static_step(hidden, token.view(1, 1), position, causal_allowed(position, self.max_len))
            token = self.to_target(self._logits(hidden)[0, -1].argmax(-1).view(1))
            drafted.append(token)
        return torch.cat(drafted)

    def _static_tree(self, hidden: torch.Tensor, logits: torch.Tensor, depth: int, topk: int, total: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``build_dynamic_tree``'s tree as one graph (decode/tree.py ``grow_static_tree``) from the last committed
        output (hidden [1, 1, H], logits [V']), each level as ``tree_expand`` runs it, written from the cache's write
        slot pointed at ``_committed`` + level x topk."""

        def expand(level: int, node_hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                   allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            self.cache.write_at.copy_(self._committed + level * topk)
            out = self._static_step(node_hidden, self.to_target(ids), positions, allowed)
            return out, self._logits(out)[0]

        kept, parents, levels, mask = grow_static_tree(expand, hidden, logits, self._committed, self.max_len, depth,
                                                       topk, total)
        return self.to_target(kept), parents, levels, mask

    @torch.no_grad()
    def _commit(self, inputs: torch.Tensor, tokens: torch.Tensor) -> None:
        """Pairs (input_j, x_{j+1}) for the next n positions: inputs [1, n, input_width], tokens [1, n]."""
        start = self.cache.length
        if self._commits is not None:  # StaticBlocks refuses a block past the cache by name (a prompt runs eagerly)
            self.cache.begin(start)
            out, logits = self._commits.causal(inputs, tokens, start)
            self.next_logits = logits[0, -1]
        else:
            out = self._step(self.project(inputs), tokens, start)
            self.next_logits = self._logits(out[:, -1:])[0, -1]
        self.cache.rollback(start + tokens.shape[1])
        self.last_hidden = out[:, -1:]

    def begin(self, prompt_ids: torch.Tensor, states: TargetOutput, next_token: int) -> None:
        self.cache.rollback(0)
        tokens = torch.cat([prompt_ids[:, 1:], torch.tensor([[next_token]], device=prompt_ids.device)], dim=1)
        self._commit(self.commit_input(states), tokens.to(self.device))

    def update(self, emitted: list[int], states: TargetOutput) -> None:
        self._commit(self.commit_input(states), torch.tensor([emitted], device=self.device))

    # -- chains (decode/chain.py) ---------------------------------------------------------------------
    def chain_room(self, k: int) -> int:
        self._chain_hidden = self.last_hidden  # what step i >= 1 feeds back: the previous step's output
        return k

    def chain_logits(self, i: int, previous: torch.Tensor | None) -> torch.Tensor:
        """Step i: the layer's previous output with draft i-1, one position further, in a speculative slot after the
        committed ones (the next commit overwrites it)."""
        if previous is None:
            return self.next_logits
        self._chain_hidden = self._step(self._chain_hidden, previous.view(1, 1), self.cache.length - 1 + i)
        return self._logits(self._chain_hidden)[0, -1]

    @torch.no_grad()
    def propose(self, k: int) -> torch.Tensor:
        """The greedy chain as one compiled graph where it fits (a confidence stop cannot leave a graph early: the
        threshold's chains run step by step), else step by step."""
        length = self.cache.length
        if self._chain is not None and self._chain.fits(length, k) and not self.confidence_threshold:
            self.cache.begin(length - 1)
            return self._chain(self.last_hidden, self.next_logits, k, length)
        return super().propose(k)

    # -- trees (decode/tree.py) ------------------------------------------------------------------
    @torch.no_grad()
    def dynamic_tree(self, spec: DynamicTree) -> tuple[torch.Tensor, ...] | None:
        """The full-depth EAGLE-2 tree of ``spec`` as one compiled graph (decode/static_blocks.py ``TreeGraph``), or
        None (not compiled, or it cannot be one graph)."""
        if self._tree is None:
            return None
        length = self.cache.length
        self._committed.fill_(length)
        self.cache.begin(length)  # the tree's slots are speculative: the next commit overwrites them
        return self._tree(self.last_hidden, self.next_logits, spec.depth, spec.topk, spec.total_tokens, length)

    def tree_root(self) -> torch.Tensor:
        """Start a tree below the last committed pair: the root's children logits [V']."""
        self._tree_hidden = self.last_hidden.new_zeros(0, self.last_hidden.shape[-1])  # outputs of expanded nodes
        self._expanded = ExpandedNodes(self.device)
        return self.next_logits

    @torch.no_grad()
    def tree_expand(self, parents: torch.Tensor, tokens: torch.Tensor, depth: int) -> torch.Tensor:
        """Run m nodes at ``depth`` (the pair: parent's output, node token), each attending to the committed context,
        its expanded ancestors and itself at rotary position length-1+depth -- training step ``depth``'s pattern.
        Returns their children's logits [m, V']."""
        m, done, committed = tokens.numel(), self._expanded.count, self.cache.length
        pool = torch.cat([self.last_hidden[0], self._tree_hidden])  # row 0: the root's output
        hidden = pool[parents + 1].unsqueeze(0)  # [1, m, H]
        new_anc = self._expanded.add(parents)  # [m, done+m]
        allowed = torch.cat([torch.ones(m, committed, dtype=torch.bool, device=self.device), new_anc], dim=1)
        positions = torch.full((m,), committed - 1 + depth, device=self.device)
        out = self._step(hidden, self.to_target(tokens).view(1, m), committed + done, positions, allowed)
        self._tree_hidden = torch.cat([self._tree_hidden, out[0]])
        return self._logits(out)[0]

    # -- a batch (decode/batch_generate.py) --------------------------------------------------------
    @property
    def rows(self) -> RaggedBlocks:
        """The batch path's ragged cache (a layer for each draft layer; compiled with ``compile``), built when a batch
        first needs it."""
        if self._rows is None:
            self._rows = RaggedBlocks(self.layer, self.max_len, self.device, self.compile, self.backend,
                                      num_layers=self.num_layers)
        return self._rows

    @property
    def lengths(self) -> list[int]:
        """Committed draft positions per row of the batch."""
        return self.rows.lengths

    def precompile_batch(self, batch: int, max_block: int) -> None:
        """With ``compile``: the layer's blocks of 1..max_block pairs (a commit of k + 1, a draft step's 1) for
        ``batch`` rows, compiled now."""
        self.rows.precompile(batch, range(1, max_block + 1), self.hidden_size, self.dtype)

    @torch.no_grad()
    def _commit_rows(self, inputs: torch.Tensor, tokens: torch.Tensor, counts: list[int]) -> None:
        """Row b's next counts[b] pairs: inputs [B, n, input_width], tokens [B, n] (padded past counts[b])."""
        out = self.rows(self.project(inputs), tokens, self.lengths, counts)
        self.rows.commit(counts)
        last = torch.tensor(counts, device=out.device) - 1
        self.rows_hidden = out[torch.arange(out.shape[0], device=out.device), last].unsqueeze(1)
        self.rows_logits = self._logits(self.rows_hidden)[:, -1]

    def begin_batch(self, prompts: list[torch.Tensor], states: TargetOutput, next_tokens: list[int]) -> None:
        """Prompts [1, T_b] each, the target's states over the right-padded batch [B, T_max, ...], first tokens."""
        tokens, counts = shifted_prompts(prompts, next_tokens)
        self.rows.reset(len(prompts))
        self._commit_rows(self.commit_input(states)[:, : max(counts)], tokens.to(self.device), counts)

    def update_batch(self, emitted: list[list[int]], states: TargetOutput) -> None:
        """Row b's emitted tokens and the target's states [B, n_max, ...] of the positions that produced them."""
        tokens, counts = padded_rows(emitted, self.device)
        self._commit_rows(self.commit_input(states)[:, : max(counts)], tokens, counts)

    @torch.no_grad()
    def chain_rows(self, steps: int, pick) -> torch.Tensor:
        """Step i >= 1 of every row: its previous output with its draft i-1, in a speculative slot after the row's
        committed ones."""
        tokens: list[torch.Tensor] = []
        hidden, logits = self.rows_hidden, self.rows_logits
        lengths = self.lengths
        for i in range(steps):
            if i > 0:
                hidden = self.rows(hidden, tokens[-1][:, None], [n - 1 + i for n in lengths], [1] * len(lengths))
                logits = self._logits(hidden)[:, -1]
            tokens.append(self.to_target(pick(logits)))
        if not tokens:
            return torch.empty(len(lengths), 0, dtype=torch.long, device=self.device)
        return torch.stack(tokens, dim=1)

    def select(self, rows: list[int]) -> None:
        """Keep only these rows of the batch, in this order (finished sequences leave it)."""
        self.rows.select(rows)
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.rows_hidden, self.rows_logits = self.rows_hidden[index], self.rows_logits[index]
