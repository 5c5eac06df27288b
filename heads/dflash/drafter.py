"""DFlash drafting: one draft forward fills a block of drafts (z-lab's ``dflash_generate``, vLLM's and SGLang's loop).

The target's states at committed positions go into the draft's context cache once (each layer's keys and values of
``hidden_norm(fc(features))``). A round runs the block [bonus, MASK x (B-1)] at positions length..length+B-1 over
the whole context, bidirectionally inside the block, and reads B-1 drafts from slots 1..B-1: a chain of k <= B-1
keeps the first k (the block is the one trained, whatever k). The block's own keys are not kept.

The drafts of a round are independent given the context (one forward), so a tree is Medusa's: a node at depth d has
slot d+1's candidates whatever its parent, and sampling draws each slot from its own distribution, which the usual
verification keeps lossless. A batch runs one drafter per row (``PerSequence``): the context caches are ragged and
the blocks short, so rows are drafted one after another. With ``compile`` the block's forward is one dynamic-shape
graph (its context length varies).
"""

from __future__ import annotations

import torch

from headstart.decode.batch_generate import RowByRow
from headstart.decode.confidence import confident_prefix
from headstart.decode.drafter import Capabilities
from headstart.decode.static_blocks import compile_step
from headstart.heads.dflash.module import DFlashDraft
from headstart.models.target import TargetOutput


class DFlashDrafter(RowByRow):
    # Trees of one block's candidates by slot; a batch row by row; --compile compiles the block's forward (one graph
    # for every context length), not a batch path.
    capabilities = Capabilities(trees=("dynamic", "static"), batches=True, sampled=True, compiled=True, confidence=True,
                                reads_aux=True)

    def __init__(self, head: DFlashDraft, max_len: int, compile: bool = False, backend: str = "inductor") -> None:
        """``compile``: the block's forward through ``torch.compile`` with dynamic shapes (the context it reads grows
        every round: one graph for every length)."""
        self.head = head.eval()
        self.max_len = max_len
        self.compile, self.backend = compile, backend
        self._blocks = compile_step(head.blocks, head.fc.weight.device, backend, dynamic=True) if compile else head.blocks
        c = head.config
        device, dtype = head.fc.weight.device, head.fc.weight.dtype
        shape = (1, c.num_key_value_heads, max_len, c.head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(c.num_hidden_layers)]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.length = 0  # committed context positions
        self.bonus = 0  # the last emitted token: slot 0 of the next block
        self.confidence_threshold = 0.0
        self.tree_logits: torch.Tensor | None = None

    @property
    def block_size(self) -> int:
        return self.head.config.block_size

    def precompile(self, max_block: int = 1, trees: bool = True) -> None:
        """Nothing is compiled (the contract's method)."""

    @torch.no_grad()
    def _commit(self, aux_hidden: torch.Tensor) -> None:
        n = aux_hidden.shape[1]
        if self.length + n > self.max_len:
            raise ValueError(f"DFlash context cache overflow: {self.length + n} > max_len {self.max_len} (raise --max-len)")
        positions = torch.arange(self.length, self.length + n, device=aux_hidden.device).unsqueeze(0)
        for layer, (k, v) in enumerate(self.head.context_kv(self.head.context(aux_hidden), positions)):
            self.keys[layer][:, :, self.length : self.length + n] = k
            self.values[layer][:, :, self.length : self.length + n] = v
        self.length += n

    def begin(self, prompt_ids: torch.Tensor, states: TargetOutput, next_token: int) -> None:
        self.length = 0
        self._commit(states.aux_hidden_states)
        self.bonus = int(next_token)

    def update(self, emitted: list[int], states: TargetOutput) -> None:
        """The target's states at the positions that produced ``emitted`` (the old bonus and the accepted drafts)."""
        self._commit(states.aux_hidden_states[:, : len(emitted)])
        self.bonus = int(emitted[-1])

    @property
    def drafts_per_block(self) -> int:
        return self.head.drafts_per_block

    @torch.no_grad()
    def _block_out(self) -> torch.Tensor:
        """The round's block over the whole context: the layers' output at its D draft slots [D, H]."""
        head, device = self.head, self.keys[0].device
        tokens = torch.full((1, self.block_size), head.config.mask_token_id, dtype=torch.long, device=device)
        tokens[0, 0] = self.bonus
        positions = torch.arange(self.length, self.length + self.block_size, device=device).unsqueeze(0)
        context = [(k[:, :, : self.length], v[:, :, : self.length]) for k, v in zip(self.keys, self.values)]
        out = self._blocks(tokens, positions, context, None)  # every context position precedes the block
        return out[0, head.first_draft_slot:]

    @torch.no_grad()
    def _block(self) -> torch.Tensor:
        """The round's drafts' logits [D, V]."""
        return self.head.logits(self._block_out()).float()

    @torch.no_grad()
    def propose(self, k: int) -> torch.Tensor:
        logits = self._block()[:k]
        drafts = logits.argmax(-1)
        return drafts[: confident_prefix(logits, drafts, self.confidence_threshold)]

    @torch.no_grad()
    def propose_sampled(self, k: int, sampling, generator: torch.Generator | None = None):
        """Each slot's draft sampled from its warped distribution: (tokens [k], q [k, V])."""
        q = sampling.probs(self._block()[:k])
        return torch.multinomial(q, 1, generator=generator).view(-1), q

    # -- trees (decode/tree.py): Medusa's, from one block's slots -----------------------------------
    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids  # the target's vocab

    def tree_root(self) -> torch.Tensor:
        self.tree_logits = self._block()
        return self.tree_logits[0]

    def tree_expand(self, parents: torch.Tensor, tokens: torch.Tensor, depth: int) -> torch.Tensor:
        """The children of m nodes at ``depth`` are slot depth+1's candidates, the same for every node."""
        if depth >= self.drafts_per_block:
            raise ValueError(f"this {self.head.config.variant} head fills blocks of {self.block_size} (drafts "
                             f"{self.drafts_per_block} tokens); a tree deeper than {self.drafts_per_block} levels cannot "
                             "be drafted (lower --tree-depth)")
        return self.tree_logits[depth].expand(tokens.numel(), -1)

    # -- a batch (decode/batch_generate.py): one drafter per row -------------------------------------
    def row_drafter(self) -> "DFlashDrafter":
        drafter = type(self)(self.head, self.max_len, self.compile, self.backend)
        drafter.confidence_threshold = self.confidence_threshold
        return drafter


class ChainedBlockDrafter(DFlashDrafter):
    """A block drafter whose draft j depends on draft j-1 (DSpark's Markov bias, DFlash2's candidate selector): one block
    forward, then the block's slots read one after another, each slot's logits from its state and the token drafted
    before it (the bonus token for the first). A variant supplies ``_slot_logits`` (and ``_slot_confidence`` if it
    predicts acceptance); the chain (greedy, sampled, the confidence stop) and the trees are written here. A tree node's
    children are the next slot's logits given the node's own token."""

    def _slot_logits(self, h: torch.Tensor, unary: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """m nodes at one slot: its normed states h [m, H], its lm_head logits [m, V] and each node's previous token
        [m] -> the slot's logits [m, V]."""
        raise NotImplementedError

    def _slot_confidence(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        """The predicted chance (a logit [m]) that each node's draft is accepted; None: no such head."""
        return None

    @torch.no_grad()
    def _slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The round's block: its normed draft-slot states [D, H] and their lm_head logits [D, V]."""
        h = self.head.norm(self._block_out())
        return h, self.head.lm_head(h.to(self.head.lm_head_dtype)).float()

    @torch.no_grad()
    def _chain(self, k: int, pick) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Up to k drafts, each picked by ``pick(logits [V]) -> (token [1], row it was drawn from [V])`` given the one
        before: (tokens [k'], their rows [k', V], confidence logits [k'] or None). No host sync."""
        h, unary = self._slots()
        k = min(k, len(h))
        prev = torch.full((1,), self.bonus, dtype=torch.long, device=h.device)
        tokens, rows, confidences = [torch.zeros(0, dtype=torch.long, device=h.device)], [], []
        for j in range(k):
            token, row = pick(self._slot_logits(h[j : j + 1], unary[j : j + 1], prev)[0])
            confidence = self._slot_confidence(h[j : j + 1], prev)
            tokens.append(token)
            rows.append(row)
            if confidence is not None:
                confidences.append(confidence)
            prev = token
        return torch.cat(tokens), torch.stack(rows) if rows else unary[:0], torch.cat(confidences) if confidences else None

    def _kept(self, tokens: torch.Tensor, rows: torch.Tensor, confidences: torch.Tensor | None, probs: bool) -> int:
        """How many drafts the round verifies under ``confidence_threshold``: with a confidence head, up to and with the
        first draft whose predicted survival prod_{i <= j} sigmoid(c_i) is under it (decode/confidence.py's rule: the
        first unsure draft is still verified); without, the draft's own probability."""
        t = self.confidence_threshold
        if t <= 0 or tokens.numel() == 0:
            return tokens.numel()
        if confidences is None:
            return confident_prefix(rows.log() if probs else rows, tokens, t)
        survival = torch.sigmoid(confidences).cumprod(0)
        return min(int((survival >= t).sum()) + 1, tokens.numel())  # a running product: the sure ones are a prefix

    @torch.no_grad()
    def propose(self, k: int) -> torch.Tensor:
        tokens, rows, confidences = self._chain(k, lambda logits: (logits.argmax(-1, keepdim=True), logits))
        return tokens[: self._kept(tokens, rows, confidences, probs=False)]

    @torch.no_grad()
    def propose_sampled(self, k: int, sampling, generator: torch.Generator | None = None):
        """Each draft sampled from its slot's warped distribution given the draft before it: (tokens [k'], q [k', V])."""
        def pick(logits: torch.Tensor):
            q = sampling.probs(logits.unsqueeze(0))[0]
            return torch.multinomial(q, 1, generator=generator), q

        tokens, q, confidences = self._chain(k, pick)
        kept = self._kept(tokens, q, confidences, probs=True)
        return tokens[:kept], q[:kept]

    def tree_root(self) -> torch.Tensor:
        self.tree_h, self.tree_logits = self._slots()
        prev = torch.full((1,), self.bonus, dtype=torch.long, device=self.tree_h.device)
        return self._slot_logits(self.tree_h[:1], self.tree_logits[:1], prev)[0]

    def tree_expand(self, parents: torch.Tensor, tokens: torch.Tensor, depth: int) -> torch.Tensor:
        """The children of m nodes at ``depth``: slot depth+1's logits given each node's own token."""
        super().tree_expand(parents, tokens, depth)  # its depth check
        m = tokens.numel()
        return self._slot_logits(self.tree_h[depth].expand(m, -1), self.tree_logits[depth].expand(m, -1), tokens)
