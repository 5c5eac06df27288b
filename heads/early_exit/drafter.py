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

from headstart.decode.confidence import confident_prefix
from headstart.decode.drafter import Capabilities, Drafter
from headstart.heads.early_exit.module import EarlyExitAdapter
from headstart.models.target import TargetOutput


class EarlyExitDrafter(Drafter):
    # Chains on the target's own runner and cache (no trees, no batch, nothing compiled), verified by itself; it
    # runs the target's first layers, so the runner builds no aux states.
    capabilities = Capabilities(sampled=True, confidence=True, self_verify=True)

    def __init__(self, head: EarlyExitAdapter, max_len: int = 0, compile: bool = False,
                 backend: str = "inductor") -> None:
        """``max_len``, ``compile``: the contract's; the drafts run on the target's runner (``attach``), eagerly."""
        self.head = head.eval()
        self.exit_layer = head.config.exit_layer
        self.runner = None
        self.bonus = 0
        self.confidence_threshold = 0.0
        self._entered: list[torch.Tensor] = []  # this round's hidden states at layer E, one [1, H] per chain input
        self._start = 0  # the slot of x

    def attach(self, runner) -> None:
        """The target's runner, whose first E layers and KV cache the drafts use (the loop calls this first)."""
        layers = runner.target.num_layers
        if layers != self.head.config.target_num_layers:
            raise ValueError(f"this adapter was trained for a target of {self.head.config.target_num_layers} layers; "
                             f"the runner's has {layers}")
        self.runner = runner

    def precompile(self, max_block: int = 1, trees: bool = True) -> None:
        """Nothing is compiled: the drafts run the target's first layers eagerly."""

    def begin(self, prompt_ids: torch.Tensor, states: TargetOutput, next_token: int) -> None:
        if self.runner is None:
            raise ValueError("the early-exit drafter drafts on the target's runner: the loop must attach it first")
        self.bonus = int(next_token)

    def update(self, emitted: list[int], states: TargetOutput) -> None:
        self.bonus = int(emitted[-1])

    @torch.no_grad()
    def _chain(self, k: int, pick) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to k drafts, each run through layers 0..E-1 after the ones before: (ids [k'], logits [k', V])."""
        device = self.runner.device
        start = self.runner.length
        k = min(k, self.runner.max_len - start - 1)  # verification writes the bonus token and k drafts
        token = torch.tensor([[self.bonus]], device=device)
        drafts, logits = [], []
        self._entered, self._start = [], start
        for i in range(max(k, 0)):
            hidden = self.runner.forward_layers(token, self.exit_layer, start + i)
            self._entered.append(hidden[0])
            row = self.head.draft_logits(hidden[0, -1]).float()
            d = pick(row)
            drafts.append(d)
            logits.append(row)
            token = d.view(1, 1)
        if not drafts:
            return torch.zeros(0, dtype=torch.long, device=device), torch.zeros(0, self.head.config.vocab_size, device=device)
        return torch.stack(drafts), torch.stack(logits)

    def propose(self, k: int) -> torch.Tensor:
        drafts, logits = self._chain(k, lambda row: row.argmax())
        return drafts[: confident_prefix(logits, drafts, self.confidence_threshold)]

    def propose_sampled(self, k: int, sampling, generator: torch.Generator | None = None):
        """Each draft drawn from the warped draft distribution given the draws before it: (tokens [k'], q [k', V])."""
        qs = []

        def draw(row: torch.Tensor) -> torch.Tensor:
            q = sampling.probs(row.unsqueeze(0))[0]
            qs.append(q)
            return torch.multinomial(q, 1, generator=generator).view(())

        drafts, _ = self._chain(k, draw)
        q = torch.stack(qs) if qs else torch.zeros(0, self.head.config.vocab_size, device=self.runner.device)
        return drafts, q

    @torch.no_grad()
    def verify(self, block: torch.Tensor) -> tuple[torch.Tensor, TargetOutput]:
        """The target's forward over the round's block [1, 1 + k'] = [x, d_1, ..., d_k']: the tokens drafting ran
        through layers 0..E-1 (their K/V in the cache, their layer-E states kept) skip them; the rest (d_k', the last
        draft) run them now; then every one runs layers E..L-1 -> (logits [1, n, V], final states)."""
        n, have = block.shape[1], min(len(self._entered), block.shape[1])
        # The loop verifies [bonus, drafts...] right after propose: the block's tokens are the chain's inputs, so they
        # are not compared here (a host sync a round); the slot is, for free.
        if self._start != self.runner.length:
            raise ValueError("early-exit verify: the block is not at the slot this drafter just drafted from "
                             f"({self._start}; the runner's committed length is {self.runner.length})")
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
