"""Speed-up predictor for chain speculation: which k to run, from what was measured.

A round with k drafts costs ``draft(k) + verify(k + 1)`` (the drafter's k steps, then one target
forward over k + 1 tokens) and yields ``tau(k) = 1 + sum_{i<=k} A_i`` tokens, where A_i is the share
of rounds accepting at least i drafts. Under greedy verification A_i does not depend on k (whether
draft i is accepted depends only on drafts 1..i), so one run at the largest k gives every tau(k).
Plain decoding costs ``verify(1)`` per token. Predicted speed-up = tau(k) * verify(1) / round(k)
("steps only"). Rounds and plain tokens also cost Python, sampling and the drafter's update; with a
measured run those are calibrated in: the round overhead from its seconds per round, plain decoding
from its seconds per token.
"""

from __future__ import annotations

import torch

from headstart.decode.clock import median_seconds
from headstart.decode.target_runner import TargetRunner


def measure_step_times(runner: TargetRunner, drafter, prompt_ids: torch.Tensor, max_k: int = 8,
                       repeats: int = 10) -> dict[str, list[float]]:
    """At the context of ``prompt_ids``: target forward seconds for blocks of 1..max_k+1 tokens and
    drafter seconds to propose k = 1..max_k tokens (nothing is committed, so calls repeat exactly)."""
    device = prompt_ids.device
    runner.reset()
    logits, states = runner.forward(prompt_ids)
    runner.commit(prompt_ids.shape[1])
    first = int(logits[0, -1].argmax())
    drafter.begin(prompt_ids, states, first)
    block = torch.full((1, max_k + 1), first, device=device)
    verify = [median_seconds(lambda n=n: runner.forward(block[:, :n]), repeats, device) for n in range(1, max_k + 2)]
    draft = [median_seconds(lambda k=k: drafter.propose(k), repeats, device) for k in range(1, max_k + 1)]
    return {"verify_seconds": verify, "draft_seconds": draft}


def predict_speedups(acceptance_by_position: list[float | None], verify_seconds: list[float],
                     draft_seconds: list[float], overhead_seconds: float = 0.0,
                     plain_seconds_per_token: float | None = None) -> list[dict[str, float]]:
    """Predicted tau and speed-up for k = 1..len(draft_seconds); positions not measured count as 0.

    ``overhead_seconds``: per-round cost beyond the k draft steps and the verify forward (the
    drafter's update with the accepted tokens, verification, bookkeeping), e.g. calibrated from a
    measured run by ``round_overhead``; ``plain_seconds_per_token``: measured plain decoding cost
    per token (its forward plus the same kind of overhead), default the bare 1-token forward."""
    plain = verify_seconds[0] if plain_seconds_per_token is None else plain_seconds_per_token
    rows, tau = [], 1.0
    for k in range(1, len(draft_seconds) + 1):
        a = acceptance_by_position[k - 1] if k <= len(acceptance_by_position) else None
        tau += a or 0.0
        round_seconds = draft_seconds[k - 1] + verify_seconds[k] + overhead_seconds
        rows.append({"k": k, "tau": tau, "round_seconds": round_seconds, "speedup": tau * plain / round_seconds})
    return rows


def round_overhead(measured_seconds_per_round: float, k: int, verify_seconds: list[float], draft_seconds: list[float]) -> float:
    """What a measured round at chain length k cost beyond its draft steps and verify forward."""
    return max(0.0, measured_seconds_per_round - draft_seconds[k - 1] - verify_seconds[k])


def recommend_k(rows: list[dict[str, float]]) -> int:
    return max(rows, key=lambda r: r["speedup"])["k"]
