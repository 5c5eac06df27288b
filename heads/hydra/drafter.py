"""Hydra drafting: head s reads the target's final hidden state at the last emitted token's position, that token
(the round's bonus token) and the drafts of heads 0..s-1, so the heads run one after another, each a few small ops.

A chain feeds each head's top-1 to the next; sampling draws each draft from its head's warped distribution and
feeds the draw (the drafts are then a sample of the chain's joint proposal, which the usual verification keeps
lossless). A tree node's children come from the head of its depth reading the node's own path -- unlike Medusa's,
children differ by parent -- so ``tree_expand`` runs one head over the m nodes' paths. A batch runs one drafter per
row (``PerSequence``): a round is a handful of [1, H] ops per row.
"""

from __future__ import annotations

import torch

from headstart.decode.batch_generate import RowByRow
from headstart.decode.confidence import confident_prefix
from headstart.decode.drafter import Capabilities
from headstart.heads.hydra.module import HydraHeads
from headstart.models.target import TargetOutput


class HydraDrafter(RowByRow):
    # Trees of its ranked candidates; a batch row by row; nothing compiled (its heads run eagerly).
    capabilities = Capabilities(trees=("dynamic", "static"), batches=True, sampled=True, confidence=True)

    def __init__(self, heads: HydraHeads, max_len: int = 0, compile: bool = False, backend: str = "inductor") -> None:
        """``max_len``: no cache to size. ``compile`` is accepted and not used: a round is a few eager ops."""
        self.heads = heads.eval()
        self.num_heads = heads.config.num_heads
        self.token_map = heads.token_map  # [V'] target ids of a truncated vocab, or None
        self.hidden: torch.Tensor | None = None  # [H] the target's state that produced the bonus token
        self.bonus = 0
        self.confidence_threshold = 0.0
        self._paths: torch.Tensor | None = None  # [n, K + 1] target-id paths (bonus first) of the expanded tree nodes
        self.max_len, self.compile, self.backend = max_len, compile, backend

    def precompile(self, max_block: int = 1, trees: bool = True) -> None:
        """Nothing is compiled (the contract's method)."""

    def begin(self, prompt_ids: torch.Tensor, states: TargetOutput, next_token: int) -> None:
        self.hidden, self.bonus = states.last_hidden_state[0, -1], int(next_token)

    def update(self, emitted: list[int], states: TargetOutput) -> None:
        """The state at the position that produced the last emitted token (the new bonus token)."""
        self.hidden, self.bonus = states.last_hidden_state[0, len(emitted) - 1], int(emitted[-1])

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.token_map is None else self.token_map[ids]

    def _logits(self, s: int, tokens: torch.Tensor) -> torch.Tensor:
        """Head s over m paths of target ids [m, s + 1] -> [m, V'] float32."""
        hidden = self.hidden.to(self.heads.embed_tokens.weight.dtype).expand(tokens.shape[0], -1)
        return self.heads.logits_of(s, hidden, tokens).float()

    @torch.no_grad()
    def _chain(self, k: int, pick) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to k drafts, head by head, each fed the ones before: (draft-vocab ids [k'], logits [k', V'])."""
        path = torch.tensor([[self.bonus]], device=self.hidden.device)
        drafts, logits = [], []
        for s in range(min(k, self.num_heads)):
            row = self._logits(s, path)[0]
            d = pick(row)
            drafts.append(d)
            logits.append(row)
            path = torch.cat([path, self.to_target(d).view(1, 1)], dim=1)
        if not drafts:
            empty = torch.zeros(0, dtype=torch.long, device=self.hidden.device)
            return empty, torch.zeros(0, self.heads.config.draft_vocab_size, device=self.hidden.device)
        return torch.stack(drafts), torch.stack(logits)

    def propose(self, k: int) -> torch.Tensor:
        drafts, logits = self._chain(k, lambda row: row.argmax())
        return self.to_target(drafts[: confident_prefix(logits, drafts, self.confidence_threshold)])

    def full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[m, V'] -> [m, V]: a truncated vocab's logits in the target's (-inf elsewhere)."""
        if self.token_map is None:
            return logits
        full = logits.new_full((logits.shape[0], self.heads.config.vocab_size), float("-inf"))
        full[:, self.token_map] = logits
        return full

    @torch.no_grad()
    def propose_sampled(self, k: int, sampling, generator: torch.Generator | None = None):
        """Each draft drawn from its head's warped distribution given the draws before it: (tokens [k'], q [k', V])."""
        qs = []

        def draw(row: torch.Tensor) -> torch.Tensor:
            q = sampling.probs(self.full_vocab(row.unsqueeze(0)))[0]
            qs.append(q)
            token = torch.multinomial(q, 1, generator=generator).view(())
            return token if self.token_map is None else torch.searchsorted(self.token_map, token)

        drafts, _ = self._chain(k, draw)
        q = torch.stack(qs) if qs else torch.zeros(0, self.heads.config.vocab_size, device=self.hidden.device)
        return self.to_target(drafts), q

    # -- trees (decode/tree.py) ----------------------------------------------------------------------
    def tree_root(self) -> torch.Tensor:
        root = torch.zeros(1, self.num_heads + 1, dtype=torch.long, device=self.hidden.device)
        root[0, 0] = self.bonus
        self._root, self._paths = root, root[:0]
        return self._logits(0, root[:, :1])[0]

    def tree_expand(self, parents: torch.Tensor, tokens: torch.Tensor, depth: int) -> torch.Tensor:
        """m nodes at ``depth`` (draft-vocab ``tokens``) below expanded ``parents`` (-1: the root): head ``depth``
        over each node's own path."""
        if depth >= self.num_heads:
            raise ValueError(f"these Hydra heads predict {self.num_heads} tokens ahead; a tree deeper than "
                             f"{self.num_heads} levels cannot be drafted (shorten the tree paths or --tree-depth)")
        known = torch.cat([self._root, self._paths])  # row 0: the root; row i + 1: expanded node i
        paths = known[parents + 1].clone()
        paths[:, depth] = self.to_target(tokens)
        self._paths = torch.cat([self._paths, paths])
        return self._logits(depth, paths[:, : depth + 1])

    # -- a batch (decode/batch_generate.py): one drafter per row -------------------------------------
    def row_drafter(self) -> "HydraDrafter":
        return HydraDrafter(self.heads, self.max_len)
