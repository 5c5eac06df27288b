"""Stop a chain where the drafter is unsure of its own draft (transformers' ``assistant_confidence_threshold``).

A draft is worth its verify slot and its next draft step only while it is likely to be accepted, and a drafter's own
probability of its draft estimates that. With a threshold p > 0 a chain stops after the first draft whose probability
is below p: that draft is still verified (one more token in a verify forward costs a fraction of the forward, and it
is accepted with about that probability), the steps after it are not run. The rule reads only the drafter's side, so
greedy output stays the target's greedy decoding and sampling stays lossless: how many drafts a round verifies may
depend on anything but the target's verdicts on them. When sampling, the probability read is the draft's under the
warped q it was drawn from (as transformers reads its assistant's processed scores): at a low temperature a draft the
raw softmax doubts is all but certain to be drawn, and accepted as often as the target's own q agrees.
"""

from __future__ import annotations

import torch


def confident(logits: torch.Tensor, draft: torch.Tensor, threshold: float, probs: torch.Tensor | None = None) -> bool:
    """Whether the drafter gave its draft (one id) a probability of at least ``threshold``: under ``probs`` (the
    distribution it was sampled from, [V] or [1, V]) where given, else under ``logits``' softmax (the one row [V] or
    [1, V] a greedy draft was picked from). One host sync; always True at threshold 0 (no sync)."""
    if threshold <= 0:
        return True
    if probs is None:
        probs = torch.softmax(logits.float().reshape(-1), dim=0)
    return bool(probs.reshape(-1)[draft.reshape(())] >= threshold)


def confident_prefix(logits: torch.Tensor, drafts: torch.Tensor, threshold: float) -> int:
    """How many of n drafts picked at once (logits [n, V], drafts [n]: parallel heads) a chain keeps: up to and with
    the first one under ``threshold`` (``confident``'s rule, one host sync)."""
    if threshold <= 0 or drafts.numel() == 0:
        return drafts.numel()
    probs = torch.softmax(logits.float(), dim=-1).gather(-1, drafts.view(-1, 1)).view(-1)
    unsure = (probs < threshold).nonzero()
    return drafts.numel() if unsure.numel() == 0 else int(unsure[0]) + 1


def with_threshold(make, threshold: float):
    """A drafter factory (``make() -> drafter``) whose drafters stop their chains under ``threshold``; refused by name
    for a drafter without the rule."""
    if not threshold:
        return make

    def made():
        drafter = make()
        if not drafter.capabilities.confidence:
            raise ValueError(f"{type(drafter).__name__} declares no confidence rule: it cannot stop a chain early")
        drafter.confidence_threshold = threshold
        return drafter

    return made
