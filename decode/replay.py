"""Replay speculative decoding over outputs the target already produced: the acceptance of any drafter, chain or tree
shape, with the drafter running for real and the target never run again.

Greedy verification accepts a draft exactly where it equals the target's greedy continuation, and the target's states
at an accepted position are the ones it has at that position of its own output. So one plain greedy decode of a prompt
and one forward over the whole (prompt + output) fix everything a greedy speculative run of that prompt would see from
the target: ``ReplayRunner`` answers the generation loop's verify forwards from them. The drafter's rounds, the loop
and its accepted counts are the real ones (decode/generate.py, unchanged); a round costs the drafter's time plus a
lookup, so a sweep of many shapes costs a fraction of decoding each (benchmarks/tree_shapes.py).

What replay leaves out: the verify forward's time and a tree's cache move (model them from measured costs:
benchmarks/tree_shapes.py), reduced-precision near-ties (a block forward and the one-token forwards of plain
decoding can round a near-tie of the target's logits differently: decode/exactness.py), and what follows the output's
last token: past an end-of-sequence token no draft is accepted, where a real run may accept drafts there that the
output then drops (its tokens and rounds are the same; only that round's accepted count can be lower). The states the
drafter reads come from one forward over the whole sequence rather than from the rounds' blocks: the same values up to
rounding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from headstart.decode.clock import RoundClock
from headstart.decode.generate import plain_generate
from headstart.decode.target_runner import TargetRunner, in_place_prefix
from headstart.models.target import TargetOutput


@dataclass
class Turn:
    prompt: torch.Tensor  # [1, P]
    output: list[int]  # the target's greedy tokens after the prompt (EOS included when hit)
    states: TargetOutput  # [1, P + len(output), ...]: the target's states over prompt + output


@torch.no_grad()
def record_turn(runner: TargetRunner, prompt: torch.Tensor, max_new_tokens: int, eos_ids: set[int],
                clock: RoundClock | None = None) -> Turn:
    """Plain greedy decoding of ``prompt`` on ``runner`` (timed by ``clock``), then one forward over prompt + output
    for its states."""
    output = plain_generate(runner, prompt, max_new_tokens, eos_ids, clock=clock).tokens
    runner.reset()
    full = torch.cat([prompt, torch.tensor([output], device=prompt.device)], dim=1)
    _, states = runner.forward(full, last_only=True)  # the states at every position; no [T, V] logits
    runner.reset()
    return Turn(prompt, output, states)


class ReplayRunner:
    """Stands in for ``TargetRunner`` over one recorded ``Turn`` (greedy loops only: its logits are one-hot).

    A forward of n tokens after the committed ones (a chain, or a tree with ``tree_mask`` and ``depths``) puts token i
    at position start + depth_i. Token i is *on the target's path* when it and all its ancestors equal the recorded
    sequence at their positions; there its logits pick the recorded next token and its states are the recorded ones.
    Elsewhere nothing the loop reads depends on them (greedy acceptance stops at the first token off the path).
    What a real runner would spend is recorded to be modelled afterwards: ``blocks``, each verify forward as (tokens,
    masked); ``moves``, the cache slots each tree round's ``keep`` moves. ``fake_seconds``: time spent building the
    one-hot logits, which a real run does not have."""

    def __init__(self, turn: Turn, vocab_size: int) -> None:
        self.sequence = torch.cat([turn.prompt[0], torch.tensor(turn.output, device=turn.prompt.device)])
        self.states = turn.states
        self.vocab_size = vocab_size
        self.device = turn.prompt.device
        self.reset()

    def reset(self) -> None:
        self.length = 0
        self.blocks: list[tuple[int, bool]] = []
        self.moves: list[int] = []
        self.fake_seconds = 0.0

    def commit(self, n: int) -> None:
        self.length += n

    def keep(self, path: list[int]) -> None:
        self.moves.append(len(path) - in_place_prefix(path))  # the slots TargetRunner.keep would move
        self.length += len(path)

    def forward(self, input_ids: torch.Tensor, tree_mask: torch.Tensor | None = None,
                depths: torch.Tensor | None = None, last_only: bool = False, **_) -> tuple[torch.Tensor, TargetOutput]:
        n, start, total = input_ids.shape[1], self.length, self.sequence.numel()
        if start:
            self.blocks.append((n, tree_mask is not None or depths is not None))
        offsets = torch.arange(n, device=self.device) if depths is None else depths.to(self.device)
        allowed = torch.ones(n, n, dtype=torch.bool, device=self.device).tril() if tree_mask is None else tree_mask
        positions = start + offsets
        past_end = torch.full((n,), -1, dtype=torch.long, device=self.device)
        recorded = torch.where(positions < total, self.sequence[positions.clamp(max=total - 1)], past_end)
        on_path = ~(allowed & (input_ids[0] != recorded)[None, :]).any(dim=1)
        following = positions + 1
        nxt = torch.where(following < total, self.sequence[following.clamp(max=total - 1)], past_end)
        choice = torch.where(on_path & (nxt >= 0), nxt, torch.zeros_like(nxt))  # off the path: never read
        t0 = time.perf_counter()
        logits = torch.zeros(1, n, self.vocab_size, device=self.device)
        logits[0, torch.arange(n, device=self.device), choice] = 1.0
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.fake_seconds += time.perf_counter() - t0
        states = self.states.select(positions.clamp(max=self.states.last_hidden_state.shape[1] - 1))
        if last_only:
            logits = logits[:, -1:]
        return logits, states
