"""Medusa drafting: head i's prediction for token t+i+1 from the target's final hidden state at t.

After every verification the target's state at the last accepted position (the one that produced
the token just emitted) is read once; all K heads run on it, and their logits serve the whole
round. The heads do not see each other's tokens, so a chain is the top-1 of heads 1..k, and a tree
node at depth d with rank r is head d's rank-r token whatever its parent (Medusa's static trees);
``tree_expand`` therefore runs nothing.

A batch of any size (``begin_batch``/``propose_batch``/``update_batch``/``select``: decode/batch_generate.py) runs
every head once per round on the stacked last states of all rows, eagerly: a round is one ResBlock and lm_head per head
over [B, H], a few ops.

``rank_accuracy`` measures, on the target's own greedy outputs, how often head i's rank-r token is
the target's next-but-i token: the input of ``decode.tree.best_static_tree``.
"""

from __future__ import annotations

import torch

from headstart.decode.confidence import confident_prefix
from headstart.decode.drafter import Capabilities, Drafter
from headstart.decode.generate import plain_generate
from headstart.decode.static_blocks import compile_step
from headstart.decode.target_runner import TargetRunner
from headstart.heads.medusa.module import MedusaHeads
from headstart.models.target import TargetOutput


class MedusaDrafter(Drafter):
    # Greedy drafts only (q one-hot); a batch's few ops run eagerly.
    capabilities = Capabilities(trees=("dynamic", "static"), batches=True, compiled=True, confidence=True)

    def __init__(self, heads: MedusaHeads, max_len: int = 0, compile: bool = False, backend: str = "inductor") -> None:
        """``max_len``: no cache to size. ``compile``: the heads through ``torch.compile`` (one static shape: a
        hidden state in, K rows of logits out), CUDA graphs on a GPU; reuse one drafter so it compiles once."""
        self.heads = heads.eval()
        device = next(heads.parameters()).device
        self._head_logits = compile_step(heads.head_logits, device, backend) if compile else heads.head_logits
        self._copy = compile and device.type == "cuda"  # a CUDA graph's output is overwritten by its next replay
        self.num_heads = heads.config.num_heads
        self.token_map = heads.token_map  # [V'] target ids of a truncated vocab, or None
        self.logits: torch.Tensor | None = None  # [K, V']: head i's logits for the token after the next one
        self.confidence_threshold = 0.0  # > 0: a chain stops after a draft its head is less sure of (decode/confidence.py)
        self.rows_drafts: torch.Tensor | None = None  # [B, K] a batch's top-1 of each head for every row, as target ids

    @torch.no_grad()
    def precompile(self, max_block: int = 1, trees: bool = True) -> None:
        """With ``compile``: compile the heads now (one shape, whatever the block or shape of draft)."""
        weight = next(self.heads.parameters())
        self._head_logits(torch.zeros(self.heads.config.hidden_size, dtype=weight.dtype, device=weight.device))

    @torch.no_grad()
    def _read(self, states: TargetOutput) -> None:
        if self._copy:
            torch.compiler.cudagraph_mark_step_begin()
        logits = self._head_logits(states.last_hidden_state[0, -1])
        self.logits = logits.clone().float() if self._copy else logits.float()  # [K, V']

    def begin(self, prompt_ids: torch.Tensor, states: TargetOutput, next_token: int) -> None:
        self._read(states)

    def update(self, emitted: list[int], states: TargetOutput) -> None:
        self._read(states)

    def propose(self, k: int) -> torch.Tensor:
        """The top-1 of heads 1..min(k, K), as target ids, cut after the first a head is unsure of
        (``confidence_threshold``)."""
        logits = self.logits[: min(k, self.num_heads)]
        drafts = logits.argmax(-1)
        return self.to_target(drafts[: confident_prefix(logits, drafts, self.confidence_threshold)])

    # -- trees (decode/tree.py) ------------------------------------------------------------------
    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.token_map is None else self.token_map[ids]

    def tree_root(self) -> torch.Tensor:
        return self.logits[0]

    def tree_expand(self, parents: torch.Tensor, tokens: torch.Tensor, depth: int) -> torch.Tensor:
        """The children of m nodes at ``depth`` are head depth+1's candidates, the same for every node."""
        if depth >= self.num_heads:
            raise ValueError(f"these Medusa heads predict {self.num_heads} tokens ahead; a tree deeper than "
                             f"{self.num_heads} levels cannot be drafted (shorten the tree paths or --tree-depth)")
        return self.logits[depth].expand(tokens.numel(), -1)


    # -- a batch (decode/batch_generate.py) --------------------------------------------------------
    @torch.no_grad()
    def _read_rows(self, states: TargetOutput, counts: list[int]) -> None:
        """Row b's state at its counts[b]-th position: the one that produced its last emitted token."""
        hidden = states.last_hidden_state
        last = hidden[torch.arange(hidden.shape[0], device=hidden.device), torch.tensor(counts, device=hidden.device) - 1]
        self.rows_drafts = self.to_target(self.heads.head_logits(last).argmax(-1).T)  # [B, K]

    def begin_batch(self, prompts: list[torch.Tensor], states: TargetOutput, next_tokens: list[int]) -> None:
        self._read_rows(states, [p.shape[1] for p in prompts])

    def update_batch(self, emitted: list[list[int]], states: TargetOutput) -> None:
        self._read_rows(states, [len(e) for e in emitted])

    def propose_batch(self, budgets: list[int]) -> list[torch.Tensor]:
        return [self.rows_drafts[b, : min(k, self.num_heads)] for b, k in enumerate(budgets)]

    def select(self, rows: list[int]) -> None:
        self.rows_drafts = self.rows_drafts[torch.tensor(rows, dtype=torch.long, device=self.rows_drafts.device)]


@torch.no_grad()
def rank_accuracy(runner: TargetRunner, heads: MedusaHeads, prompts: list[torch.Tensor], max_new_tokens: int,
                  eos_ids: set[int], max_rank: int = 10) -> torch.Tensor:
    """[K, max_rank]: share of positions where head i's rank-r token (0 = its argmax) is the token the
    target's greedy decoding emits i+1 tokens after the next one, over the continuations of ``prompts``."""
    K = heads.config.num_heads
    hits = torch.zeros(K, max_rank, dtype=torch.float64)
    counts = torch.zeros(K, dtype=torch.float64)
    for prompt in prompts:
        out = plain_generate(runner, prompt, max_new_tokens, eos_ids)
        sequence = torch.cat([prompt[0], torch.tensor(out.tokens, device=prompt.device)]).unsqueeze(0)
        runner.reset()
        _, states = runner.forward(sequence)
        start = prompt.shape[1] - 1  # the position that predicts the first generated token
        hidden = states.last_hidden_state[0]  # [L, H]
        L = hidden.shape[0]
        for i in range(K):
            # positions t >= start whose token t+i+2 (head i+1's target) lies inside the sequence
            for first in range(start, L - i - 2, 256):  # [K, 256, V] float32 at a time, not [K, L, V]
                t = torch.arange(first, min(first + 256, L - i - 2), device=hidden.device)
                scores = heads.logits_of(i, hidden[t]).float()  # [m, V']
                truth, named = draft_index(heads.token_map, sequence[0, t + i + 2])
                rank = (scores > scores.gather(1, truth[:, None])).sum(-1)  # [m] rank of the true token
                rank = torch.where(named, rank, max_rank)  # a token the heads cannot name is never ranked
                hits[i] += torch.bincount(rank.clamp(max=max_rank), minlength=max_rank + 1)[:max_rank].double().cpu()
                counts[i] += t.numel()
    return hits / counts.clamp(min=1)[:, None]


def draft_index(token_map: torch.Tensor | None, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Target ids -> (their row in a truncated vocab, whether they are in it); the identity without one."""
    if token_map is None:
        return ids, torch.ones_like(ids, dtype=torch.bool)
    index = torch.searchsorted(token_map, ids).clamp(max=len(token_map) - 1)
    return index, token_map[index] == ids
