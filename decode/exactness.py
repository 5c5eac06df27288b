"""Greedy exactness in reduced precision: is a speculative run's first differing token a decoder bug or a near-tie?

Speculative greedy decoding equals plain greedy decoding token for token only where both compute the same logits.
In float32 they do (to ~1e-6), so any difference is a bug. In bfloat16 they do not: the verify forward runs a
block of k+1 tokens, plain decoding one token, and the two shapes take different GEMM/attention kernels with
different summation orders, so logits differ by a few bf16 steps (eps 2^-7, relative). Where the target's top two
tokens are that close, the two runs pick different tokens and then continue from different prefixes -- the
continuation is still the target's greedy output of its own prefix. transformers' assisted generation differs
from plain `generate` at the same places for the same reason.

So at a run's first differing token we ask the target itself: one forward over the prompt and the common prefix
(a third summation order), and the gap between the logits of the token plain decoding chose and the one
speculative decoding chose. A gap within ``TIE_STEPS`` steps of the dtype's resolution at that logit's magnitude is
a near-tie (numerics); anything larger is a real difference. In float32 the tolerance is ~1e-5, so the check is as
strict as token equality was.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TIE_STEPS = 8
"""How many of the dtype's relative resolution steps (``finfo.eps`` x the logit's magnitude) two logits may differ by
and still count as a tie. Block and one-token bf16 forwards of the demo target and SmolLM2 differ by a few steps;
a drafter or cache bug changes the chosen token regardless of the gap (tests/test_exactness.py)."""


@dataclass(frozen=True)
class Divergence:
    """Where a speculative greedy run first differs from plain greedy decoding, and by how much the target prefers
    plain decoding's token there (``margin`` = its logit minus speculative decoding's token's logit)."""

    position: int
    plain_token: int | None
    spec_token: int | None
    margin: float
    tolerance: float
    dtype: str

    @property
    def near_tie(self) -> bool:
        return abs(self.margin) <= self.tolerance

    def describe(self) -> str:
        verdict = "near-tie" if self.near_tie else "differs"
        return (f"token {self.position}: {verdict} (logit gap {self.margin:.4g}, {self.dtype} tolerance "
                f"{self.tolerance:.3g})")


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (a length difference counts at the shorter's end), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.no_grad()
def divergence(model: torch.nn.Module, prompt: torch.Tensor, plain: list[int], spec: list[int]) -> Divergence | None:
    """Compare ``spec`` with ``plain`` (new tokens after ``prompt``, shape [1, P]) at their first difference, by one
    forward of the HF causal LM ``model`` over the prompt and the common prefix. None where they are equal. A run
    that stopped early (one sequence a prefix of the other) is never a tie: the margin is infinite."""
    i = first_difference(plain, spec)
    if i is None:
        return None
    dtype = next(model.parameters()).dtype
    a = plain[i] if i < len(plain) else None
    b = spec[i] if i < len(spec) else None
    if a is None or b is None:
        return Divergence(i, a, b, float("inf"), 0.0, str(dtype).removeprefix("torch."))
    ids = torch.cat([prompt[:1], torch.tensor([plain[:i]], dtype=prompt.dtype, device=prompt.device)], dim=1)
    logits = model(input_ids=ids, use_cache=False).logits[0, -1].float()
    la, lb = logits[a].item(), logits[b].item()
    tolerance = TIE_STEPS * torch.finfo(dtype).eps * max(abs(la), abs(lb), 1.0)
    return Divergence(i, a, b, la - lb, tolerance, str(dtype).removeprefix("torch."))


class GreedyCheck:
    """Collects a benchmark's comparisons of speculative with plain greedy decoding: ``mismatches`` (real
    differences, the check fails) and ``near_ties`` (first differences at a near-tie of the target's logits)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.mismatches: list[str] = []
        self.near_ties: list[str] = []

    def compare(self, where: str, prompt: torch.Tensor, plain: list[int], spec: list[int]) -> None:
        d = divergence(self.model, prompt, plain, spec)
        if d is not None:
            (self.near_ties if d.near_tie else self.mismatches).append(f"{where}, {d.describe()}")
