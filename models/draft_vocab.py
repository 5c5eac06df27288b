"""The draft vocabulary: the V_d target tokens a head predicts, as EAGLE-3's ``d2t`` / ``t2d``.

``target_id = draft_id + d2t[draft_id]`` (offsets, as vLLM and SGLang read them); ``t2d`` is a bool
mask over the target vocab, true exactly at the used ids.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def build_draft_vocab(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From per-target-token counts [V], keep the ``draft_vocab_size`` most frequent; return (d2t, t2d).

    Ids are sorted ascending. When fewer distinct tokens occur, the rest is padded with the
    smallest unused ids (count 0), so the head always has exactly ``draft_vocab_size`` outputs.
    """
    vocab_size = token_counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in 1..{vocab_size} (the target vocab), got {draft_vocab_size}")
    # Most frequent first; among equal counts the lower id wins, so the choice is deterministic.
    # float64 holds count * (V + 1) exactly for any realistic count and vocab.
    ids = torch.arange(vocab_size, dtype=torch.float64)
    key = token_counts.to(torch.float64) * (vocab_size + 1) - ids
    chosen = torch.topk(key, draft_vocab_size).indices
    used = torch.sort(chosen).values.to(torch.int64)
    d2t = used - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def count_tokens(sequences: Iterable[tuple[list[int], list[int]]], vocab_size: int) -> torch.Tensor:
    """Count the loss-masked tokens of (input_ids, loss_mask) pairs: what the head must predict."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids, mask in sequences:
        ids_t = torch.as_tensor(ids, dtype=torch.int64)
        trained = ids_t[torch.as_tensor(mask, dtype=torch.bool)]
        if trained.numel() and int(trained.max()) >= vocab_size:
            raise ValueError(f"token id {int(trained.max())} is outside the target vocab of {vocab_size}: "
                             "was the data tokenized with another tokenizer?")
        counts += torch.bincount(trained, minlength=vocab_size)
    return counts


def check_draft_vocab(d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """The invariants the servers rely on (docs/FORMATS.md section A)."""
    if d2t.is_meta:  # a head built on the meta device (headstart plan) has shapes, no values to check
        return
    used = torch.arange(d2t.numel()) + d2t
    if used.numel() > 1 and not bool((used[1:] > used[:-1]).all()):
        raise ValueError("d2t: arange(V_d) + d2t must be strictly increasing")
    if int(used.min()) < 0 or int(used.max()) >= t2d.numel():
        raise ValueError(f"d2t maps outside the target vocab [0, {t2d.numel()})")
    if int(t2d.sum()) != d2t.numel() or not bool(t2d[used].all()):
        raise ValueError("t2d must be true exactly at the ids d2t maps to")
