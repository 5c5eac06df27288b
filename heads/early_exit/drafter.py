"""Early-exit drafting: each draft runs the target's first E layers on one token, on the target's own KV cache
(``TargetRunner.forward_layers``), then the adapter, the target's final norm and lm_head.

A round from bonus token x: x, d_1, ..., d_{k-1} each run through layers 0..E-1 at the slots after the committed
tokens, writing those layers' K/V there. Verification (``verify``, LayerSkip's reuse) then runs d_k through layers
0..E-1 and the whole block [x, d_1, ..., d_k] through layers E..L-1 only, from the hidden states drafting left at
layer E: the first E layers run once per token, draft or not, and their K/V live in one cache, the target's. Nothing
is kept between rounds but the bonus token. Chains only, one sequence: the cache it drafts on is the target's, which
a batch splits by row.
"""

from __future__ import annotations

import torch

from headstart.decode.chain import SelfDraftChain
from headstart.decode.drafter import Capabilities
from headstart.heads.early_exit.module import EarlyExitAdapter
from headstart.models.target import TargetOutput


class EarlyExitDrafter(SelfDraftChain):
    # Chains on the target's own runner and cache (no trees, no batch, nothing compiled), verified by itself; it
    # runs the target's first layers, so the runner builds no aux states.
    capabilities = Capabilities(sampled=True, confidence=True, self_verify=True)

    def __init__(self, head: EarlyExitAdapter, max_len: int = 0, compile: bool = False,
                 backend: str = "inductor") -> None:
        """``max_len``, ``compile``: the contract's; the drafts run on the target's runner (``attach``), eagerly."""
        self.head = head.eval()
        self.exit_layer = head.config.exit_layer
        self.target_vocab_size = head.config.vocab_size
        self.what = "the early-exit drafter"
        self.confidence_threshold = 0.0
        self._entered: list[torch.Tensor] = []  # this round's hidden states at layer E, one [1, H] per chain input

    def attach(self, runner) -> None:
        """The target's runner, whose first E layers and KV cache the drafts use (the loop calls this first)."""
        layers = runner.target.num_layers
        if layers != self.head.config.target_num_layers:
            raise ValueError(f"this adapter was trained for a target of {self.head.config.target_num_layers} layers; "
                             f"the runner's has {layers}")
        super().attach(runner)

    def precompile(self, max_block: int = 1, trees: bool = True) -> None:
        """Nothing is compiled: the drafts run the target's first layers eagerly."""

    # -- chains (decode/chain.py): draft i runs draft i-1 (the bonus token first) through layers 0..E-1 -----------
    def chain_room(self, k: int) -> int:
        self._entered = []
        return self.start_round(k)

    def chain_logits(self, i: int, previous: torch.Tensor | None) -> torch.Tensor:
        token = torch.tensor([[self.bonus]], device=self.device) if previous is None else previous.view(1, 1)
        hidden = self.runner.forward_layers(token, self.exit_layer, self._start + i)
        self._entered.append(hidden[0])
        return self.head.draft_logits(hidden[0, -1]).float()

    @torch.no_grad()
    def verify(self, block: torch.Tensor) -> tuple[torch.Tensor, TargetOutput]:
        """The target's forward over the round's block [1, 1 + k'] = [x, d_1, ..., d_k']: the tokens drafting ran
        through layers 0..E-1 (their K/V in the cache, their layer-E states kept) skip them; the rest (d_k', the last
        draft) run them now; then every one runs layers E..L-1 -> (logits [1, n, V], final states)."""
        n, have = block.shape[1], min(len(self._entered), block.shape[1])
        # The loop verifies [bonus, drafts...] right after propose: the block's tokens are the chain's inputs, so they
        # are not compared here (a host sync a round); the slot is, for free.
        self.check_slot()
        parts = self._entered[:have]
        if have < n:
            parts.append(self.runner.forward_layers(block[:, have:], self.exit_layer, self._start + have)[0])
        self._entered = []
        return self.runner.forward_from(torch.cat(parts).unsqueeze(0), self.exit_layer, self._start)

    # -- what it cannot do, said by name ---------------------------------------------------------------
    def tree_root(self) -> torch.Tensor:
        raise ValueError("early-exit drafting runs chains only (its drafts share the target's cache slots)")

    def begin_batch(self, prompts, states, next_tokens) -> None:
        raise ValueError("early-exit drafting runs one sequence at a time (it drafts on the target's own cache): "
                         "use --batch-size 1")
