"""Cross-entropy over a full target vocabulary (V = 128k-150k for real targets) without a [N, V]
float32 tensor per head: positions go through in chunks, and each chunk's logits -- and the
teacher's distribution -- are recomputed in backward (activation checkpointing), so only the
chunk's [n, H] inputs are kept. Used by every head that predicts the target's full vocab.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import record_function
from torch.utils.checkpoint import checkpoint

from headstart.models.fused_loss import fused_linear_loss, triton_usable
from headstart.models.head import Features, StepTally, loss_denominator


@dataclass
class VocabProjection:
    """A head's vocab projection written as ``logits = pre(x) @ weight.T``, so that the loss can run it through
    the fused Triton kernels (models/fused_loss.py) instead of calling it as a black box."""

    pre: Callable[[torch.Tensor], torch.Tensor]
    weight: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.pre(x), self.weight).float()


def use_fused(project: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> bool:
    """Whether a ``VocabProjection``'s loss runs through the fused Triton kernels: ``HEADSTART_LOSS_KERNEL`` =
    ``auto`` (default: on a GPU), ``triton`` (also on CPU, under ``TRITON_INTERPRET=1``: the tests) or ``torch``
    (never). Not under ZeRO-3, whose partitioned weights exist whole only inside their module's call (and whose
    lockstep gathers ``chunked_vocab_loss`` keeps)."""
    choice = os.environ.get("HEADSTART_LOSS_KERNEL", "auto")
    if choice not in ("auto", "triton", "torch"):
        raise ValueError(f"HEADSTART_LOSS_KERNEL={choice!r}: expected auto, triton or torch")
    if not isinstance(project, VocabProjection) or hasattr(project.weight, "ds_id") or choice == "torch":
        return False
    return triton_usable(x) and (x.is_cuda or choice == "triton")


def lockstep_chunks(n: int, chunk_tokens: int, device: torch.device) -> int:
    """Chunks to run for n positions: the most any rank needs. ZeRO-3 gathers a module's weights at
    every call, collectively, so every rank must call the projection the same number of times."""
    count = torch.tensor([max(1, -(-n // chunk_tokens))], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count)


def divergence_sum(divergence: str, logp: torch.Tensor, logq: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Summed over n positions, the divergence of the draft's q from the target's p (log-probabilities [n, V]):
    ``kl`` as cross-entropy -sum p log q (forward KL plus p's entropy, a constant: the same gradient), ``rkl``
    sum q (log q - log p), ``jsd`` the mean of KL(p || m) and KL(q || m) for m = (p + q) / 2, ``tv``
    sum |p - q| / 2 = 1 - alpha, and ``lk`` -log alpha, where alpha = sum min(p, q) is the probability that a draft
    token sampled from q is accepted (arXiv 2602.23881's LK^alpha; its gradient is TV's scaled by 1 / alpha, so it
    does not stall where the two barely overlap, as TV does). ``weights`` [n]: each position's divergence weighted."""
    rows = divergence_rows(divergence, logp, logq)
    return rows.sum() if weights is None else (rows * weights).sum()


def divergence_rows(divergence: str, logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """``divergence_sum``'s terms, one per position [n]."""
    p = logp.exp()
    if divergence == "kl":
        return -(p * logq).sum(-1)
    q = logq.exp()
    if divergence == "rkl":
        return (q * (logq - logp)).sum(-1)
    if divergence == "jsd":
        logm = torch.logaddexp(logp, logq) - math.log(2.0)
        return 0.5 * ((p * (logp - logm)).sum(-1) + (q * (logq - logm)).sum(-1))
    if divergence == "tv":
        return 0.5 * (p - q).abs().sum(-1)
    if divergence == "lk":
        return -torch.minimum(p, q).sum(-1).clamp_min(1e-6).log()  # the floor keeps a zero overlap finite
    raise ValueError(f"unknown divergence {divergence!r}")


def chunked_vocab_loss(project: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                       teacher: Callable[[torch.Tensor], torch.Tensor], teacher_h: torch.Tensor, labels: torch.Tensor,
                       soft: bool, chunk_tokens: int, recompute: bool = True, vocab_ids: torch.Tensor | None = None,
                       divergence: str = "kl", full_metrics: bool = True, weights: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Summed cross-entropy of ``project(x)`` [N, V] against the teacher's distribution
    ``softmax(teacher(teacher_h))`` (``soft``) or the ``labels`` [N]; also per position whether the
    draft's argmax equals the teacher's, whether the teacher's argmax is in the draft's top 5, and (``soft``)
    the expected acceptance sum min(p, q) of a draft token sampled from q against the teacher's p.

    Empty chunks are run too (see ``lockstep_chunks``), so every parameter gets a gradient on every rank.
    ``recompute=False`` keeps each chunk's logits for backward instead of recomputing them (faster when small).

    ``vocab_ids`` [V'] (ascending target ids): the draft predicts only these tokens (a truncated vocab, e.g.
    Medusa's ``token_map``). The teacher's distribution is then restricted to them and renormalised, a data
    label outside them is not trained, and accuracy still compares with the teacher's full-vocab argmax: a
    position whose right token the draft cannot name counts as wrong, as it is when decoding.

    ``divergence`` (``soft`` only; ``divergence_sum``): what q is trained against p with; the fused kernels compute
    forward KL, so any other runs the chunked torch path.

    ``full_metrics=False`` (``Features.full_metrics``): top-5 and sum min(p, q) are None, not computed -- each is
    another pass over the [n, V] logits (the fused kernels compute them in their one pass, so they always do).

    ``weights`` [N] (no gradient): each position's loss weighted in the sum (DFlash's D-PACE); runs the chunked torch
    path."""
    if divergence != "kl" and not soft:
        raise ValueError(f"draft.loss={divergence!r} compares the draft with the target's distribution; it needs soft "
                         "labels (the target's), not the data's tokens")
    with record_function("head: vocab loss"):  # a part of the step for torch.profiler (benchmarks/profile_step.py)
        if vocab_ids is not None or weights is not None:
            return _chunks(project, x, teacher, teacher_h, labels, soft, chunk_tokens, recompute, vocab_ids, divergence,
                           full_metrics, weights)
        if divergence == "kl" and use_fused(project, x):
            return fused_linear_loss(project.pre(x), project.weight, teacher, teacher_h, labels, soft, chunk_tokens)
        return _chunks(project, x, teacher, teacher_h, labels, soft, chunk_tokens, recompute, None, divergence,
                       full_metrics)


def _chunks(project, x, teacher, teacher_h, labels, soft, chunk_tokens, recompute, vocab_ids, divergence, full_metrics,
            weights=None):
    N = x.shape[0]
    loss_sum = torch.zeros((), dtype=torch.float32, device=x.device)
    correct, top5, accept = [], [], []
    for c in range(lockstep_chunks(N, chunk_tokens, x.device)):
        part = slice(c * chunk_tokens, (c + 1) * chunk_tokens)
        args = (project, teacher, x[part], teacher_h[part], labels[part], soft, vocab_ids, divergence, full_metrics,
                None if weights is None else weights[part])
        if recompute and torch.is_grad_enabled():  # keep only the chunk's inputs; backward recomputes its logits
            chunk_loss, draft_top, draft_top1, target_top1, chunk_accept = checkpoint(_chunk, *args, use_reentrant=False)
        else:
            chunk_loss, draft_top, draft_top1, target_top1, chunk_accept = _chunk(*args)
        loss_sum = loss_sum + chunk_loss
        correct.append(draft_top1 == target_top1)  # argmax on both sides: ties go to the first id alike
        if full_metrics:
            top5.append((draft_top == target_top1[:, None]).any(-1))
            accept.append(chunk_accept)
    return loss_sum, torch.cat(correct), torch.cat(top5) if full_metrics else None, torch.cat(accept) if full_metrics else None


@dataclass(frozen=True)
class TeacherRows:
    """A teacher computed once per batch, for a draft with a truncated vocab: its logits over that vocab and its
    full-vocab argmax at every position, read by row index (``teacher_h`` then holds the rows). Every step of a
    multi-step head reads the same positions shifted, so this replaces one full-vocab teacher product per step
    and per backward recomputation with one per position."""

    logits: torch.Tensor  # [N, V'] float32, over vocab_ids
    top1: torch.Tensor  # [N] the teacher's full-vocab argmax (target ids)

    @classmethod
    @torch.no_grad()
    def compute(cls, teacher: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, vocab_ids: torch.Tensor,
                chunk_tokens: int) -> "TeacherRows":
        """``hidden`` [N, H] -> the teacher's rows, ``chunk_tokens`` positions at a time (no [N, V] at once)."""
        logits, top1 = [], []
        for part in hidden.split(chunk_tokens):
            z = teacher(part).float()  # [n, V]
            top1.append(z.argmax(-1))
            logits.append(z[:, vocab_ids])
        return cls(torch.cat(logits), torch.cat(top1))


def _chunk(project, teacher, x: torch.Tensor, teacher_h: torch.Tensor, labels: torch.Tensor, soft: bool,
           vocab_ids: torch.Tensor | None = None, divergence: str = "kl", full_metrics: bool = True,
           weights: torch.Tensor | None = None):
    """Summed loss of n positions, the draft's top-5 ids [n, 5] and argmax [n], the teacher's argmax [n] and
    sum min(p, q) [n]; ids are target ids (``vocab_ids`` maps a truncated draft's outputs to them). Without
    ``full_metrics`` the top-5 ids and sum min(p, q) are None."""
    with torch.no_grad():
        if isinstance(teacher, TeacherRows):
            teacher_logits, target_top1 = teacher.logits[teacher_h], teacher.top1[teacher_h]  # [n, V'], [n]
        else:
            teacher_logits = teacher(teacher_h).float()  # [n, V]
            target_top1 = teacher_logits.argmax(-1)
            if vocab_ids is not None:
                teacher_logits = teacher_logits[:, vocab_ids]  # [n, V']: renormalised over what the draft can say
        logp = torch.log_softmax(teacher_logits, -1) if soft else None
        p = logp.exp() if soft else None
        del teacher_logits
        if vocab_ids is not None and not soft:  # target id -> draft index; a token outside the vocab is not trained
            index = torch.searchsorted(vocab_ids, labels).clamp(max=len(vocab_ids) - 1)
            labels = torch.where(vocab_ids[index] == labels, index, -100)
    logq = torch.log_softmax(project(x).float(), -1)  # [n, V']
    if soft:
        loss = divergence_sum(divergence, logp, logq, weights)
    elif weights is None:
        loss = F.nll_loss(logq, labels, reduction="sum", ignore_index=-100)
    else:
        loss = (F.nll_loss(logq, labels, reduction="none", ignore_index=-100) * weights).sum()
    draft = logq.detach()
    top1 = draft.argmax(-1)
    top5 = accept = None
    if full_metrics:
        with torch.no_grad():
            accept = torch.minimum(p, logq.exp()).sum(-1) if soft else torch.zeros(len(x), device=x.device)
        top5 = draft.topk(min(5, logq.shape[-1]), -1).indices
    if vocab_ids is not None:
        top1 = vocab_ids[top1]
        top5 = None if top5 is None else vocab_ids[top5]
    return loss, top5, top1, target_top1, accept


def multi_step_loss(steps: Iterable[tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]], f: Features,
                    teacher: Callable[[torch.Tensor], torch.Tensor], soft: bool, step_weight: float,
                    chunk_tokens: int, vocab_ids: torch.Tensor | None = None,
                    divergence: str = "kl") -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of a head whose step s (s = 0, 1, ...) predicts, at position t, token t+2+s -- Medusa's
    head s+1, MTP's unrolled step s: ``steps`` yields (project, draft states [B, T, D]) per step,
    ``project`` mapping draft states to logits over the full vocab (or over ``vocab_ids``: see
    ``chunked_vocab_loss``).

    Position t is trained at step s when token t+2+s is an assistant token; the label is the target's
    distribution at t+1+s (``soft``, from ``teacher`` over ``f.last_hidden_state``) or that token.
    Loss = sum_s step_weight**s x the step's summed loss / ``loss_denominator(f)``. Metrics per step: loss,
    top-1 and top-5 accuracy against the target's argmax; ``sim_accept_len`` = 1 + sum_s P(steps 0..s
    all right | all trained at t), a greedy chain's tokens per target forward under teacher forcing."""
    target_h = f.last_hidden_state  # [B, T, H]
    B, T, H = target_h.shape
    rows = None
    if vocab_ids is not None and soft:  # small enough to keep for every position: computed once, not per step
        rows = TeacherRows.compute(teacher, target_h.reshape(B * T, H), vocab_ids, chunk_tokens)
    denominator = loss_denominator(f)
    total = torch.zeros((), dtype=torch.float32, device=target_h.device)
    tally = StepTally()
    for s, (project, draft) in enumerate(steps):
        valid = torch.zeros_like(f.loss_mask, dtype=torch.bool)
        if s + 2 < T:
            valid[:, : T - s - 2] = f.loss_mask[:, s + 2 :].bool()
        valid = f.within_document(valid, s + 2)  # a packed batch: token t+2+s in t's document
        b, t = valid.nonzero(as_tuple=True)  # the trained positions
        teacher_s, teacher_h = (teacher, target_h[b, t + 1 + s]) if rows is None else (rows, b * T + t + 1 + s)
        step_sum, correct, top5, accept = chunked_vocab_loss(project, draft[b, t], teacher_s, teacher_h,
                                                          f.input_ids[b, t + 2 + s], soft, chunk_tokens,
                                                          vocab_ids=vocab_ids, divergence=divergence,
                                                          full_metrics=f.full_metrics)
        total = total + (step_weight**s) * step_sum / denominator
        tally.add(valid, b, t, step_sum, correct, top5=top5, accept=accept if soft else None)
    return total, tally.metrics(f.loss_mask)
