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
from headstart.decode.chain import ChainDrafter
from headstart.decode.drafter import Capabilities
from headstart.heads.hydra.module import HydraHeads
from headstart.models.target import TargetOutput


class HydraDrafter(RowByRow, ChainDrafter):
    # Trees of its ranked candidates; a batch row by row; nothing compiled (its heads run eagerly).
    capabilities = Capabilities(trees=("dynamic", "static"), batches=True, sampled=True, confidence=True)

    def __init__(self, heads: HydraHeads, max_len: int = 0, compile: bool = False, backend: str = "inductor") -> None:
        """``max_len``: no cache to size. ``compile`` is accepted and not used: a round is a few eager ops."""
        self.heads = heads.eval()
        self.num_heads = heads.config.num_heads
        self.token_map = heads.token_map  # [V'] target ids of a truncated vocab, or None
        self.device, self.target_vocab_size = heads.embed_tokens.weight.device, heads.config.vocab_size
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

    def draft_vocab(self) -> torch.Tensor | None:
        return self.token_map

    def _logits(self, s: int, tokens: torch.Tensor) -> torch.Tensor:
        """Head s over m paths of target ids [m, s + 1] -> [m, V'] float32."""
        hidden = self.hidden.to(self.heads.embed_tokens.weight.dtype).expand(tokens.shape[0], -1)
        return self.heads.logits_of(s, hidden, tokens).float()

    # -- chains (decode/chain.py): head s reads the bonus token and the s drafts before it ----------------
    def chain_room(self, k: int) -> int:
        return min(k, self.num_heads)

    def chain_logits(self, i: int, previous: torch.Tensor | None) -> torch.Tensor:
        token = torch.tensor([[self.bonus]], device=self.hidden.device) if previous is None else previous.view(1, 1)
        self._path = token if previous is None else torch.cat([self._path, token], dim=1)
        return self._logits(i, self._path)[0]

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
