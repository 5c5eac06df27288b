"""EAGLE-3 drafting at inference, consistent with its training-time test: one drafter for one sequence or a batch.

Draft position j pairs the target's aux feature f_j with token x_{j+1}, and its output predicts
x_{j+2}. Committed pairs live in the draft's own KV cache (one layer). To propose k tokens from
the last committed position t, step i (i >= 1) feeds back the previous step's hidden output with
the token just drafted, at rotary position t + i, attending to the committed keys plus the keys of
its own earlier steps -- the same attention pattern and positions as TTT step i.

Both paths run the head's one step (``Eagle3Draft.step``, training's) over their own cache:
- one sequence (``begin``/``propose``/``update`` and the tree methods: decode/generate.py's loops) on a one-row cache
  whose compiled form is a whole chain or tree as one graph (decode/static_blocks.py);
- a batch of any size, 1 included (``begin_batch``/``propose_batch``/``update_batch``/``select``:
  decode/batch_generate.py's loop), on a ragged cache (decode/ragged_blocks.py): row b's committed length its own, its
  padding attending only to itself, its speculative slots overwritten by its next commit.
The one-sequence path serves batch 1: trees, ``--confidence-threshold`` and the compiled whole-chain and whole-tree
graphs exist there only, and its decoding is what ``benchmarks/versus_revision.py`` holds against earlier revisions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from headstart.decode.batch_generate import padded_rows, shifted_prompts
from headstart.decode.chain import ChainDrafter
from headstart.decode.drafter import Capabilities
from headstart.decode.kv_cache import static_address
from headstart.decode.ragged_blocks import RaggedBlocks
from headstart.decode.static_blocks import ChainGraph, StaticBlocks, TreeGraph, causal_allowed
from headstart.decode.tree import DynamicTree, ExpandedNodes, grow_static_tree
from headstart.heads.eagle3.module import Eagle3Draft
from headstart.models.target import TargetOutput


class Eagle3Drafter(ChainDrafter):
    # Trees of its own ranked candidates (and the full-depth one as one compiled graph); its own batch rows.
    capabilities = Capabilities(trees=("dynamic", "static"), batches=True, sampled=True, compiled=True, compiled_batch=True,
                                confidence=True, reads_aux=True)

    def __init__(self, head: Eagle3Draft, max_len: int, compile: bool = False, backend: str = "inductor") -> None:
        """``compile``: the draft step through ``torch.compile`` at static shapes (decode/static_blocks.py and, for a
        batch, decode/ragged_blocks.py), CUDA graphs on a GPU; build one drafter and reuse it for every prompt or batch
        (``begin``/``begin_batch`` start afresh), so it compiles once."""
        self.head = head.eval()
        self.compile, self.backend = compile, backend
        self._rows: RaggedBlocks | None = None  # the batch path's ragged cache, built at its first batch
        c = head.config
        self.max_len, self.target_vocab_size = max_len, c.vocab_size
        self.device = device = head.fc.weight.device
        dtype = head.fc.weight.dtype
        self.keys = torch.zeros(1, c.num_attention_heads, max_len, c.head_dim, device=device, dtype=dtype)
        self.values = torch.zeros_like(self.keys)
        self.write_at = torch.zeros((), dtype=torch.long, device=device)  # a compiled step's first slot
        self._blocks = self._commits = self._chain = self._tree = None
        if compile:
            static_address(self.keys, self.values, self.write_at)
            self._blocks = StaticBlocks(self._static_step, max_len, device, backend)
            # A commit (fc, the step, the draft logits) as one graph per block size, like the step: the update read
            # 1.2 ms a round on the H200 around a compiled step of a fraction of that.
            self._commits = StaticBlocks(self._static_commit, max_len, device, backend, write_at=self.write_at)
            self._chain = ChainGraph(self._static_chain, max_len, device, backend)  # compiled at its first round
            self._tree = TreeGraph(self._static_tree, max_len, device, backend)  # a dynamic tree as one graph
        self.length = 0  # committed draft positions
        self.last_hidden: torch.Tensor | None = None  # [1, 1, H] output at the last committed position
        self.last_logits: torch.Tensor | None = None  # [1, V_d]
        self.confidence_threshold = 0.0  # > 0: a chain stops after a draft it is less sure of (decode/confidence.py)
        self.rows_hidden: torch.Tensor | None = None  # [B, 1, H] a batch's output at each row's last committed position
        self.rows_logits: torch.Tensor | None = None  # [B, V_d]

    @torch.no_grad()
    def precompile(self, max_block: int, trees: bool = True) -> None:
        """With ``compile``: compile the commit for every block of up to ``max_block`` tokens now (before a prompt),
        and with ``trees`` the masked step (tree levels) too."""
        if self._blocks is not None:
            if self.length:
                raise RuntimeError("precompile writes dummy pairs from slot 0: call it before a prompt")
            self.write_at.fill_(0)
            if trees:
                self._blocks.precompile(max_block, self.head.config.hidden_size, self.head.fc.weight.dtype)
            self._commits.precompile(max_block, self.head.fc.in_features, self.head.fc.weight.dtype, masked=False)

    @torch.no_grad()
    def _step(self, hidden: torch.Tensor, tokens: torch.Tensor, start: int, positions: torch.Tensor | None = None,
              allowed: torch.Tensor | None = None) -> torch.Tensor:
        """Run the draft layer on n pairs (hidden [1, n, H], tokens [1, n]) written at slots
        [start, start+n). Defaults: rotary positions start..start+n-1 and causal attention to every
        earlier slot; a tree passes its own ``positions`` [n] and ``allowed`` [n, start+n] mask.
        Returns the layer output [1, n, H]."""
        n = tokens.shape[1]
        end = start + n
        if end > self.max_len:
            raise ValueError(f"draft KV cache overflow: {end} > max_len {self.max_len}")
        if positions is None or allowed is None:
            chain_positions, chain_allowed = self._chain_block(n, start)
            positions = chain_positions if positions is None else positions
            allowed = chain_allowed if allowed is None else allowed

        if self._blocks is not None:
            self.write_at.fill_(start)
            return self._blocks(hidden, tokens, positions, allowed, start)

        def cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.keys[:, :, start:end] = k
            self.values[:, :, start:end] = v
            return F.scaled_dot_product_attention(q, self.keys[:, :, :end], self.values[:, :, :end], attn_mask=allowed)

        return self.head.step(hidden, tokens, positions.unsqueeze(0), cached)  # training's step, a cache for attention

    def _chain_block(self, n: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A chain block's defaults for n pairs at slots [start, start + n): rotary positions start..start+n-1 [n] and
        causal attention to every earlier slot [n, start + n]."""
        positions = torch.arange(start, start + n, device=self.keys.device)
        return positions, causal_allowed(positions, start + n)

    def _static_commit(self, aux_hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                       allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``_commit``'s arithmetic for m pairs at static shapes: (the layer's outputs [1, m, H], the draft logits
        after the last of them [1, 1, V_d]: the only ones a commit reads)."""
        out = self._static_step(self.head.project(aux_hidden), tokens, positions, allowed)
        return out, self._logits(out[:, -1:])

    def _static_step(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                     allowed: torch.Tensor) -> torch.Tensor:
        """``_step`` with static shapes: m pairs written from slot ``write_at``, attending over all ``max_len`` slots
        under ``allowed`` [m, max_len]."""

        def cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            slots = self.write_at + torch.arange(k.shape[2], device=k.device)
            self.keys.index_copy_(2, slots, k)
            self.values.index_copy_(2, slots, v)
            return F.scaled_dot_product_attention(q, self.keys, self.values, attn_mask=allowed)

        return self.head.step(hidden, tokens, positions, cached)

    def _static_chain(self, hidden: torch.Tensor, logits: torch.Tensor, steps: int) -> torch.Tensor:
        """``_draft``'s greedy chain at static shapes: ``steps`` draft ids (target vocab) from the last committed
        output (hidden [1, 1, H], logits [1, V_d]), step i writing slot ``write_at`` + i at that rotary position and
        attending to every slot up to it -- what ``_step`` does for one pair with its default positions and mask."""
        token = self.to_target(logits.argmax(-1))  # [1]
        drafted = [token]
        for i in range(1, steps):
            slot = (self.write_at + i).view(1, 1)
            allowed = causal_allowed(slot, self.max_len)  # [1, max_len]

            def cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot=slot, allowed=allowed) -> torch.Tensor:
                self.keys.index_copy_(2, slot.view(1), k)
                self.values.index_copy_(2, slot.view(1), v)
                return F.scaled_dot_product_attention(q, self.keys, self.values, attn_mask=allowed)

            hidden = self.head.step(hidden, token.view(1, 1), slot, cached)
            token = self.to_target(self._logits(hidden)[:, -1].argmax(-1))
            drafted.append(token)
        return torch.cat(drafted)

    def _static_tree(self, hidden: torch.Tensor, logits: torch.Tensor, depth: int, topk: int, total: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``build_dynamic_tree``'s tree as one graph (decode/tree.py ``grow_static_tree``) from the last committed
        output (hidden [1, 1, H], logits [1, V_d]), its nodes written from slot ``write_at`` (the committed count) on,
        each level as ``tree_expand`` runs it."""

        def expand(level: int, node_hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                   allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            slots = self.write_at + level * topk + torch.arange(topk, device=ids.device)

            def cached(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
                self.keys.index_copy_(2, slots, key)
                self.values.index_copy_(2, slots, value)
                return F.scaled_dot_product_attention(q, self.keys, self.values, attn_mask=allowed)

            out = self.head.step(node_hidden, self.to_target(ids), positions, cached)
            return out, self._logits(out)[0]

        kept, parents, levels, mask = grow_static_tree(expand, hidden, logits[0], self.write_at, self.max_len, depth,
                                                       topk, total)
        return self.to_target(kept), parents, levels, mask

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.draft_logits(hidden)

    @torch.no_grad()
    def _commit(self, aux_hidden: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Pairs (f_j, x_{j+1}) for the next n positions: aux [1, n, k*H], tokens [1, n]."""
        aux_hidden = aux_hidden.to(self.head.fc.weight.dtype)
        n = next_tokens.shape[1]
        if self._commits is not None:  # StaticBlocks refuses a block past the cache by name
            self.write_at.fill_(self.length)
            out, logits = self._commits.causal(aux_hidden, next_tokens, self.length)
            self.last_logits = logits[:, -1]
        else:
            out = self._step(self.head.project(aux_hidden), next_tokens, self.length)
            self.last_logits = self._logits(out[:, -1:])[:, -1]
        self.length += n
        self.last_hidden = out[:, -1:]

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.head.d2t[draft_ids]

    def begin(self, prompt_ids: torch.Tensor, states: TargetOutput, next_token: int) -> None:
        self.length = 0
        tokens = torch.cat([prompt_ids[:, 1:], torch.tensor([[next_token]], device=prompt_ids.device)], dim=1)
        self._commit(states.aux_hidden_states, tokens)

    # -- chains (decode/chain.py) ---------------------------------------------------------------------
    def draft_vocab(self) -> torch.Tensor:
        return self.head.target_vocab_ids()

    def chain_room(self, k: int) -> int:
        self._chain_hidden = self.last_hidden  # what step i >= 1 feeds back: the previous step's output
        return k

    def chain_logits(self, i: int, previous: torch.Tensor | None) -> torch.Tensor:
        """Step i (TTT step i): the previous output with draft i-1 at rotary position length - 1 + i, in a speculative
        slot after the committed ones (the next commit overwrites it)."""
        if previous is None:
            return self.last_logits[0]
        self._chain_hidden = self._step(self._chain_hidden, previous.view(1, 1), self.length - 1 + i)
        return self._logits(self._chain_hidden)[0, -1]

    @torch.no_grad()
    def propose(self, k: int) -> torch.Tensor:
        """The greedy chain as one compiled graph where it fits (no confidence stop: the graph cannot leave early),
        else step by step."""
        if self._chain is not None and self._chain.fits(self.length, k) and not self.confidence_threshold:
            self.write_at.fill_(self.length - 1)
            return self._chain(self.last_hidden, self.last_logits, k, self.length)
        return super().propose(k)

    def update(self, emitted: list[int], states: TargetOutput) -> None:
        self._commit(states.aux_hidden_states, torch.tensor([emitted], device=self.keys.device))

    # -- trees (decode/tree.py) ------------------------------------------------------------------
    @torch.no_grad()
    def dynamic_tree(self, spec: DynamicTree) -> tuple[torch.Tensor, ...] | None:
        """The full-depth EAGLE-2 tree of ``spec`` as one compiled graph (decode/static_blocks.py ``TreeGraph``), or
        None (not compiled, or it cannot be one graph)."""
        if self._tree is None:
            return None
        self.write_at.fill_(self.length)
        return self._tree(self.last_hidden, self.last_logits, spec.depth, spec.topk, spec.total_tokens, self.length)

    def tree_root(self) -> torch.Tensor:
        """Start a tree below the last committed position: the root's children logits [V_d]."""
        self._tree_hidden = self.last_hidden.new_zeros(0, self.last_hidden.shape[-1])  # outputs of expanded nodes
        self._expanded = ExpandedNodes(self.keys.device)
        return self.last_logits[0]

    @torch.no_grad()
    def tree_expand(self, parents: torch.Tensor, tokens: torch.Tensor, depth: int) -> torch.Tensor:
        """Run m nodes at ``depth`` (the pair: parent's output, node token), each attending to the
        committed context, its expanded ancestors and itself at rotary position length-1+depth --
        TTT step ``depth``'s pattern. Returns their children's logits [m, V_d]."""
        m, done, committed = tokens.numel(), self._expanded.count, self.length
        device = self.keys.device
        pool = torch.cat([self.last_hidden[0], self._tree_hidden])  # row 0: the root's output
        hidden = pool[parents + 1].unsqueeze(0)  # [1, m, H]
        new_anc = self._expanded.add(parents)  # [m, done+m]
        allowed = torch.cat([torch.ones(m, committed, dtype=torch.bool, device=device), new_anc], dim=1)
        positions = torch.full((m,), committed - 1 + depth, device=device)
        out = self._step(hidden, self.to_target(tokens).view(1, m), committed + done, positions, allowed)
        self._tree_hidden = torch.cat([self._tree_hidden, out[0]])
        return self._logits(out)[0]

    # -- a batch (decode/batch_generate.py) --------------------------------------------------------
    @property
    def rows(self) -> RaggedBlocks:
        """The batch path's ragged one-layer cache (compiled with ``compile``), built when a batch first needs it."""
        if self._rows is None:
            self._rows = RaggedBlocks(self._row_layer, self.max_len, self.keys.device, self.compile, self.backend)
        return self._rows

    @property
    def lengths(self) -> list[int]:
        """Committed draft positions per row of the batch."""
        return self.rows.lengths

    def precompile_batch(self, batch: int, max_block: int) -> None:
        """With ``compile``: the layer's blocks of 1..max_block pairs (a commit of k + 1, a draft step's 1) for ``batch``
        rows, compiled now."""
        self.rows.precompile(batch, range(1, max_block + 1), self.head.config.hidden_size, self.head.fc.weight.dtype)

    def _row_layer(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
                   cache) -> torch.Tensor:
        """``RaggedBlocks``' step: the draft layer on pairs, its attention reading the cache's visible slots."""
        layer = cache.layers[0]

        def cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys, values = layer.update(k, v)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed.unsqueeze(1))

        return self.head.step(hidden, tokens, positions, cached)

    @torch.no_grad()
    def _commit_rows(self, aux_hidden: torch.Tensor, tokens: torch.Tensor, counts: list[int]) -> None:
        """Row b's next counts[b] pairs: aux [B, n, k*H], tokens [B, n] (padded past counts[b])."""
        out = self.rows(self.head.project(aux_hidden.to(self.head.fc.weight.dtype)), tokens, self.lengths, counts)
        self.rows.commit(counts)
        last = torch.tensor(counts, device=out.device) - 1
        self.rows_hidden = out[torch.arange(out.shape[0], device=out.device), last].unsqueeze(1)
        self.rows_logits = self._logits(self.rows_hidden)[:, -1]

    def begin_batch(self, prompts: list[torch.Tensor], states: TargetOutput, next_tokens: list[int]) -> None:
        """Prompts [1, T_b] each, the target's states over the right-padded batch [B, T_max, ...], first tokens."""
        tokens, counts = shifted_prompts(prompts, next_tokens)
        self.rows.reset(len(prompts))
        self._commit_rows(states.aux_hidden_states[:, : max(counts)], tokens, counts)

    def _draft_rows(self, steps: int, pick) -> torch.Tensor:
        """``steps`` draft steps for every row; ``pick(logits [B, V_d]) -> draft ids [B]``. Returns target ids [B, steps]."""
        tokens: list[torch.Tensor] = []
        hidden, logits = self.rows_hidden, self.rows_logits
        lengths = self.lengths
        for i in range(steps):
            if i > 0:  # speculative slots after each row's committed ones
                hidden = self.rows(hidden, tokens[-1][:, None], [n - 1 + i for n in lengths], [1] * len(lengths))
                logits = self._logits(hidden)[:, -1]
            tokens.append(self.to_target(pick(logits)))
        if not tokens:
            return torch.empty(len(lengths), 0, dtype=torch.long, device=self.keys.device)
        return torch.stack(tokens, dim=1)

    @torch.no_grad()
    def propose_batch(self, budgets: list[int]) -> list[torch.Tensor]:
        drafts = self._draft_rows(max(budgets), lambda logits: logits.argmax(-1))
        return [drafts[b, :k] for b, k in enumerate(budgets)]

    @torch.no_grad()
    def propose_sampled_batch(self, budgets: list[int], sampling, generator: torch.Generator | None = None):
        """Drafts sampled from the warped draft distribution: per row (tokens [k_b], q [k_b, V]), q over the target
        vocab (zero outside the draft vocab)."""
        q_steps: list[torch.Tensor] = []

        def pick(logits: torch.Tensor) -> torch.Tensor:
            q_steps.append(sampling.probs(logits))  # [B, V_d]
            return torch.multinomial(q_steps[-1], 1, generator=generator).squeeze(1)

        drafts = self._draft_rows(max(budgets), pick)
        B, steps = drafts.shape
        q = torch.zeros(B, steps, self.head.config.vocab_size, device=self.keys.device)
        if q_steps:
            q[:, :, self.head.target_vocab_ids()] = torch.stack(q_steps, dim=1)
        return [drafts[b, :k] for b, k in enumerate(budgets)], [q[b, :k] for b, k in enumerate(budgets)]

    def update_batch(self, emitted: list[list[int]], states: TargetOutput) -> None:
        """Row b's emitted tokens and the target's states [B, n_max, ...] of the positions that produced them."""
        tokens, counts = padded_rows(emitted, self.keys.device)
        self._commit_rows(states.aux_hidden_states[:, : max(counts)], tokens, counts)

    def select(self, rows: list[int]) -> None:
        """Keep only these rows of the batch, in this order (finished sequences leave it)."""
        self.rows.select(rows)
        index = torch.tensor(rows, dtype=torch.long, device=self.keys.device)
        self.rows_hidden, self.rows_logits = self.rows_hidden[index], self.rows_logits[index]
