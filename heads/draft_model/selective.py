"""AdaSPEC's selective token filtering (arXiv 2510.19779): distil only the tokens a small draft can learn.

For each trained token, the divergence of the draft being trained (L_draft) and of a reference draft (L_ref, one
already distilled from the same target) from the target's distribution; the gap L_draft - L_ref is what the
reference shows is learnable and the draft has not learned yet. The ``keep`` fraction with the largest gap stays
trained; the rest -- mostly tokens neither draft fits, which would spend a small model's capacity on what it cannot
accept anyway -- is dropped from the loss mask.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from headstart.models.head import Features
from headstart.models.vocab_loss import divergence_rows


def token_divergences(project: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                      teacher: Callable[[torch.Tensor], torch.Tensor], teacher_h: torch.Tensor, divergence: str,
                      chunk_tokens: int) -> torch.Tensor:
    """[n] divergence of the draft (``project(x)`` [n, V]) from the target (``teacher(teacher_h)``), a chunk at a time."""
    out = []
    for i in range(0, x.shape[0], chunk_tokens):
        logq = F.log_softmax(project(x[i:i + chunk_tokens]).float(), dim=-1)
        logp = F.log_softmax(teacher(teacher_h[i:i + chunk_tokens]).float(), dim=-1)
        out.append(divergence_rows(divergence, logp, logq))
    return torch.cat(out) if out else x.new_zeros(0, dtype=torch.float32)


def keep_learnable(f: Features, draft: torch.Tensor, project: Callable[[torch.Tensor], torch.Tensor],
                   reference: torch.Tensor, ref_project: Callable[[torch.Tensor], torch.Tensor],
                   teacher: Callable[[torch.Tensor], torch.Tensor], divergence: str, keep: float,
                   chunk_tokens: int) -> torch.Tensor:
    """``f.loss_mask`` with only the ``keep`` fraction of trained tokens whose gap L_draft - L_ref is largest.

    ``draft`` and ``reference`` [B, T, H]: the two models' states, position t's predicting token t+2 (as the draft
    model's loss lays them out), the target's distribution for that token at t+1 of ``f.last_hidden_state``."""
    T = f.input_ids.shape[1]
    valid = torch.zeros_like(f.loss_mask, dtype=torch.bool)
    valid[:, : max(T - 2, 0)] = f.loss_mask[:, 2:].bool()
    valid = f.within_document(valid, 2)
    b, t = valid.nonzero(as_tuple=True)
    mask = f.loss_mask.clone()
    if b.numel() == 0:
        return mask
    teacher_h = f.last_hidden_state[b, t + 1]
    gap = (token_divergences(project, draft[b, t], teacher, teacher_h, divergence, chunk_tokens)
           - token_divergences(ref_project, reference[b, t], teacher, teacher_h, divergence, chunk_tokens))
    kept = max(1, math.ceil(keep * gap.numel()))
    dropped = torch.ones_like(gap, dtype=torch.bool)
    dropped[gap.topk(kept).indices] = False
    mask[b[dropped], t[dropped] + 2] = 0
    return mask
