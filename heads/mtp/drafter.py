"""MTP drafting at inference, consistent with its unrolled training.

Draft pair j is (the target's final hidden state at j, token x_{j+1}) at rotary position j, as
vLLM numbers it; committed pairs live in the layer's own KV cache (one layer). To propose k
tokens from the last committed pair, step i (i >= 1) feeds back the layer's previous output with the
token just drafted, one position further, attending to the committed keys and its own earlier
steps -- the attention pattern and positions of training step i. Trees expand top-k children the
same way, each node attending to the committed context, its expanded ancestors and itself.

One drafter for one sequence or a batch, both running the head's one layer over their own cache: one sequence
(``begin``/``propose``/``update``, trees) on a one-row cache whose compiled form is a whole chain or tree as one graph;
a batch of any size, 1 included (``begin_batch``/``propose_batch``/``update_batch``/``select``), on a ragged cache
(decode/ragged_blocks.py), each row's committed length its own -- as EAGLE-3's drafter does (heads/eagle3/drafter.py).
"""

from __future__ import annotations

import torch

from headstart.decode.batch_generate import padded_rows, shifted_prompts
from headstart.decode.chain import ChainDrafter
from headstart.decode.drafter import Capabilities, Drafter
from headstart.decode.kv_cache import PositionalKVCache, StaticKVCache, static_address
from headstart.decode.ragged_blocks import RaggedBlocks
from headstart.decode.static_blocks import ChainGraph, StaticBlocks, TreeGraph, causal_allowed, self_mask
from headstart.decode.tree import ExpandedNodes, grow_static_tree
from headstart.heads.mtp.module import MTPHead
from headstart.models.target import TargetOutput, additive_mask


class MTPDrafter(ChainDrafter):
    # Greedy drafts only (q one-hot); reads the final hidden state, no aux states.
    capabilities = Capabilities(trees=("dynamic", "static"), batches=True, compiled=True, compiled_batch=True, confidence=True)

    def __init__(self, head: MTPHead, max_len: int, compile: bool = False, backend: str = "inductor") -> None:
        """``compile``: the layer's step through ``torch.compile`` over a static cache (decode/static_blocks.py),
        CUDA graphs on a GPU; reuse one drafter for every prompt (``begin`` starts afresh), so it compiles once."""
        self.head = head.eval()
        self.max_len, self.target_vocab_size = max_len, head.config.vocab_size
        self.device = head.eh_proj.weight.device
        self.compile, self.backend = compile, backend
        self._rows: RaggedBlocks | None = None  # the batch path's ragged cache, built at its first batch
        self.rows_hidden: torch.Tensor | None = None  # [B, 1, H] a batch's layer output at each row's last committed pair
        self.rows_logits: torch.Tensor | None = None  # [B, V]
        self.cache = StaticKVCache(1, max_len, self.device) if compile else PositionalKVCache(1, max_len)
        self._blocks = StaticBlocks(self._static_step, max_len, self.device, backend) if compile else None  # tree levels
        # A commit (the step and its logits) as one graph per block size, its chain mask built in the graph.
        self._commits = StaticBlocks(self._static_commit, max_len, self.device, backend, write_at=self.cache.write_at) \
            if compile else None
        # a greedy chain as one graph, compiled at its first round
        self._chain = ChainGraph(self._static_chain, max_len, self.device, backend) if compile else None
        self._tree = TreeGraph(self._static_tree, max_len, self.device, backend) if compile else None  # a whole tree
        self._committed = torch.zeros((), dtype=torch.long, device=self.device)  # the committed slots, for the tree
        if compile:
            static_address(self._committed)
        self.last_hidden: torch.Tensor | None = None  # [1, 1, H] the layer's output at the last committed pair
        self.last_logits: torch.Tensor | None = None  # [V]
        self.confidence_threshold = 0.0  # > 0: a chain stops after a draft it is less sure of (decode/confidence.py)

    @torch.no_grad()
    def precompile(self, max_block: int, trees: bool = True) -> None:
        """With ``compile``: compile the step for every chain block of up to ``max_block`` tokens now (before a
        prompt), and with ``trees`` for every masked one (tree levels) too."""
        if self._blocks is not None:
            if self.cache.length:
                raise RuntimeError("precompile writes dummy pairs from slot 0: call it before a prompt")
            hidden_size, dtype = self.head.eh_proj.weight.shape[0], self.head.eh_proj.weight.dtype
            self.cache.begin(0)
            # the static cache allocated eagerly: outside a compiled graph its buffers get fixed addresses
            self._static_step(torch.zeros(1, 1, hidden_size, dtype=dtype, device=self.device),
                              torch.zeros(1, 1, dtype=torch.long, device=self.device),
                              torch.zeros(1, 1, dtype=torch.long, device=self.device),
                              self_mask(1, self.max_len, self.device))
            if trees:
                self._blocks.precompile(max_block, hidden_size, dtype)
            self._commits.precompile(max_block, hidden_size, dtype, masked=False)

    @torch.no_grad()
    def _step(self, hidden: torch.Tensor, tokens: torch.Tensor, start: int, positions: torch.Tensor | None = None,
              allowed: torch.Tensor | None = None) -> torch.Tensor:
        """The layer on n pairs (hidden [1, n, H], tokens [1, n]) written at slots [start, start+n).
        Defaults: slot s at rotary position s and causal attention over every earlier slot; a tree
        passes its own ``positions`` [n] and ``allowed`` [n, start+n]. Returns the outputs [1, n, H]."""
        n = tokens.shape[1]
        end = start + n
        if end > self.max_len:
            raise ValueError(f"MTP KV cache overflow: {end} > max_len {self.max_len}")
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
        x = self.head.fuse(tokens, hidden, positions)
        return self.head.layer(x, positions, additive_mask(allowed, x.dtype), self.cache)

    def _static_commit(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                       allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``_commit``'s arithmetic at static shapes: (the layer's outputs [1, m, H], the logits after the last of them
        [1, 1, V] in fp32: the only ones a commit reads)."""
        out = self._static_step(hidden, tokens, positions, allowed)
        return out, self.head.logits(out[:, -1:]).float()

    def _static_chain(self, hidden: torch.Tensor, logits: torch.Tensor, steps: int) -> torch.Tensor:
        """``propose`` at static shapes: ``steps`` greedy drafts from the last committed output (hidden [1, 1, H],
        logits [V]), the cache's write slot pointing at the last committed pair; step i writes the next slot, at that
        rotary position, attending to every slot up to it -- ``_step``'s default positions and mask for one pair."""
        token = logits.argmax(-1).view(1)
        drafted = [token]
        for _ in range(1, steps):
            self.cache.write_at.add_(1)  # the slot after the previous step's
            position = self.cache.write_at.clone().view(1, 1)
            hidden = self._static_step(hidden, token.view(1, 1), position, causal_allowed(position, self.max_len))
            token = self.head.logits(hidden)[0, -1].argmax(-1).view(1)
            drafted.append(token)
        return torch.cat(drafted)

    def _static_tree(self, hidden: torch.Tensor, logits: torch.Tensor, depth: int, topk: int, total: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``build_dynamic_tree``'s tree as one graph (decode/tree.py ``grow_static_tree``) from the last committed
        output (hidden [1, 1, H], logits [V]), each level as ``tree_expand`` runs it, written from the cache's write
        slot pointed at ``_committed`` + level x topk."""

        def expand(level: int, node_hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                   allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            self.cache.write_at.copy_(self._committed + level * topk)
            out = self._static_step(node_hidden, ids, positions, allowed)
            return out, self.head.logits(out)[0].float()

        return grow_static_tree(expand, hidden, logits, self._committed, self.max_len, depth, topk, total)

    @torch.no_grad()
    def _commit(self, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        """Pairs (h_j, x_{j+1}) for the next n positions: hidden [1, n, H], tokens [1, n]."""
        start = self.cache.length
        if self._commits is not None:  # (a prompt, at start 0, runs eagerly)
            if start + tokens.shape[1] > self.max_len:
                raise ValueError(f"MTP KV cache overflow: {start + tokens.shape[1]} > max_len {self.max_len}")
            self.cache.begin(start)
            out, logits = self._commits.causal(hidden, tokens, start)
            self.last_logits = logits[0, -1]
        else:
            out = self._step(hidden, tokens, start)
            self.last_logits = self.head.logits(out[:, -1:])[0, -1].float()
        self.cache.rollback(start + tokens.shape[1])
        self.last_hidden = out[:, -1:]

    def begin(self, prompt_ids: torch.Tensor, states: TargetOutput, next_token: int) -> None:
        self.cache.rollback(0)
        tokens = torch.cat([prompt_ids[:, 1:], torch.tensor([[next_token]], device=prompt_ids.device)], dim=1)
        self._commit(states.last_hidden_state, tokens.to(self.device))

    def update(self, emitted: list[int], states: TargetOutput) -> None:
        self._commit(states.last_hidden_state, torch.tensor([emitted], device=self.device))

    # -- chains (decode/chain.py) ---------------------------------------------------------------------
    # Greedy drafts only: MTP declares no sampled q, so the loop verifies its chains as one-hot (Drafter's rule).
    propose_sampled = Drafter.propose_sampled

    def chain_room(self, k: int) -> int:
        self._chain_hidden = self.last_hidden  # what step i >= 1 feeds back: the previous step's output
        return k

    def chain_logits(self, i: int, previous: torch.Tensor | None) -> torch.Tensor:
        """Step i (training step i): the layer's previous output with draft i-1, one position further, in a speculative
        slot after the committed ones (the next commit overwrites it)."""
        if previous is None:
            return self.last_logits
        self._chain_hidden = self._step(self._chain_hidden, previous.view(1, 1), self.cache.length - 1 + i)
        return self.head.logits(self._chain_hidden)[0, -1]

    @torch.no_grad()
    def propose(self, k: int) -> torch.Tensor:
        """The greedy chain as one compiled graph where it fits (no confidence stop: the graph cannot leave early),
        else step by step."""
        length = self.cache.length
        if self._chain is not None and self._chain.fits(length, k) and not self.confidence_threshold:
            self.cache.begin(length - 1)
            return self._chain(self.last_hidden, self.last_logits, k, length)
        return super().propose(k)

    # -- trees (decode/tree.py) ------------------------------------------------------------------
    @torch.no_grad()
    def dynamic_tree(self, spec) -> tuple[torch.Tensor, ...] | None:
        """The full-depth EAGLE-2 tree of ``spec`` as one compiled graph (decode/static_blocks.py ``TreeGraph``), or
        None (not compiled, or it cannot be one graph)."""
        if self._tree is None:
            return None
        length = self.cache.length
        self._committed.fill_(length)
        self.cache.begin(length)  # the tree's slots are speculative: the next commit overwrites them
        return self._tree(self.last_hidden, self.last_logits, spec.depth, spec.topk, spec.total_tokens, length)

    def tree_root(self) -> torch.Tensor:
        self._tree_hidden = self.last_hidden.new_zeros(0, self.last_hidden.shape[-1])  # outputs of expanded nodes
        self._expanded = ExpandedNodes(self.device)
        return self.last_logits

    @torch.no_grad()
    def tree_expand(self, parents: torch.Tensor, tokens: torch.Tensor, depth: int) -> torch.Tensor:
        """m nodes at ``depth`` (pair: the parent's output, the node's token), at the position of
        training step ``depth``; returns their children's logits [m, V]."""
        m, done, committed = tokens.numel(), self._expanded.count, self.cache.length
        pool = torch.cat([self.last_hidden[0], self._tree_hidden])  # row 0: the root's output
        hidden = pool[parents + 1].unsqueeze(0)  # [1, m, H]
        new_anc = self._expanded.add(parents)  # [m, done+m]
        allowed = torch.cat([torch.ones(m, committed, dtype=torch.bool, device=self.device), new_anc], dim=1)
        positions = torch.full((m,), committed - 1 + depth, device=self.device)
        out = self._step(hidden, tokens.view(1, m), committed + done, positions, allowed)
        self._tree_hidden = torch.cat([self._tree_hidden, out[0]])
        return self.head.logits(out)[0].float()

    # -- a batch (decode/batch_generate.py) --------------------------------------------------------
    @property
    def rows(self) -> RaggedBlocks:
        """The batch path's ragged one-layer cache (compiled with ``compile``), built when a batch first needs it."""
        if self._rows is None:
            self._rows = RaggedBlocks(self._row_layer, self.max_len, self.device, self.compile, self.backend)
        return self._rows

    def precompile_batch(self, batch: int, max_block: int) -> None:
        """With ``compile``: the layer's blocks of 1..max_block pairs for ``batch`` rows, compiled now."""
        self.rows.precompile(batch, range(1, max_block + 1), self.head.eh_proj.out_features, self.head.eh_proj.weight.dtype)

    def _row_layer(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
                   cache) -> torch.Tensor:
        """``RaggedBlocks``' step: the MTP layer on pairs (hidden [B, n, H], tokens [B, n]) at rotary ``positions``."""
        x = self.head.fuse(tokens, hidden, positions)
        return self.head.layer(x, positions, additive_mask(allowed, x.dtype), cache)

    @torch.no_grad()
    def _commit_rows(self, hidden: torch.Tensor, tokens: torch.Tensor, counts: list[int]) -> None:
        """Row b's next counts[b] pairs: hidden [B, n, H], tokens [B, n] (padded past counts[b])."""
        out = self.rows(hidden, tokens, self.rows.lengths, counts)
        self.rows.commit(counts)
        last = torch.tensor(counts, device=out.device) - 1
        self.rows_hidden = out[torch.arange(out.shape[0], device=out.device), last].unsqueeze(1)
        self.rows_logits = self.head.logits(self.rows_hidden)[:, -1].float()

    def begin_batch(self, prompts: list[torch.Tensor], states: TargetOutput, next_tokens: list[int]) -> None:
        """Prompts [1, T_b] each, the target's states over the right-padded batch [B, T_max, ...], first tokens."""
        tokens, counts = shifted_prompts(prompts, next_tokens)
        self.rows.reset(len(prompts))
        self._commit_rows(states.last_hidden_state[:, : max(counts)], tokens.to(self.device), counts)

    @torch.no_grad()
    def propose_batch(self, budgets: list[int]) -> list[torch.Tensor]:
        """Up to budgets[b] greedy drafts for row b: step i feeds back step i-1's output and draft."""
        tokens: list[torch.Tensor] = []
        hidden, logits = self.rows_hidden, self.rows_logits
        lengths = self.rows.lengths
        for i in range(max(budgets)):
            if i > 0:  # speculative slots after each row's committed ones
                hidden = self.rows(hidden, tokens[-1][:, None], [n - 1 + i for n in lengths], [1] * len(lengths))
                logits = self.head.logits(hidden)[:, -1]
            tokens.append(logits.argmax(-1))
        drafts = torch.stack(tokens, dim=1) if tokens else torch.empty(len(lengths), 0, dtype=torch.long, device=self.device)
        return [drafts[b, :k] for b, k in enumerate(budgets)]

    def update_batch(self, emitted: list[list[int]], states: TargetOutput) -> None:
        """Row b's emitted tokens and the target's states [B, n_max, ...] of the positions that produced them."""
        tokens, counts = padded_rows(emitted, self.device)
        self._commit_rows(states.last_hidden_state[:, : max(counts)], tokens, counts)

    def select(self, rows: list[int]) -> None:
        """Keep only these rows of the batch, in this order (finished sequences leave it)."""
        self.rows.select(rows)
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.rows_hidden, self.rows_logits = self.rows_hidden[index], self.rows_logits[index]
