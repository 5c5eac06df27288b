"""The vocab loss fused: soft cross-entropy of ``x @ weight.T`` against a teacher's distribution, with
its accuracy and sum min(p, q) metrics, that never holds a [N, V] float32 tensor.

Per chunk of positions, forward computes the chunk's logits [n, V] in the weights' dtype (bf16 on a GPU)
and one Triton program per row walks the vocab in blocks with an online softmax for the draft and the
teacher at once (log-sum-exps, sum q.z, both argmaxes, then sum min(p, q)); only the per-row
log-sum-exps are kept. Backward recomputes the chunk's logits, a second kernel overwrites them in place
with (softmax(z) - q) x grad, and two matmuls give the gradients of x and weight. Peak extra memory is one
chunk's logits in the weights' dtype, whatever N is.

Why not Liger-Kernel: its fused linear distillation losses (``LigerFusedLinearJSDLoss``, ...) take the
teacher as hidden states plus its own lm_head weight and return only the loss. Here the teacher is the
target's logits restricted to the draft vocab (already computed, or stored offline), and training
needs the per-position accuracy and sum min(p, q) from the same pass; a thin kernel over the logits
chunk does exactly that, and cuBLAS keeps the two matmuls.

``models/vocab_loss.chunked_vocab_loss`` is the PyTorch form of the same computation (the CPU path and
the reference the kernels are tested against, under ``TRITON_INTERPRET=1`` on CPU).
"""

from __future__ import annotations

import os
from typing import Callable

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path needs no triton
    triton = None


def triton_usable(t: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on ``t``'s device: on CUDA, or anywhere under the interpreter."""
    return triton is not None and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:

    @triton.jit
    def _soft_ce_fwd(z_ptr, t_ptr, label_ptr, loss_ptr, lse_z_ptr, lse_t_ptr, top1_z_ptr, top1_t_ptr, accept_ptr,
                     V, z_stride, t_stride, SOFT: tl.constexpr, BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        z_row = z_ptr + row * z_stride
        t_row = t_ptr + row * t_stride
        cols = tl.arange(0, BLOCK_V)
        neg_inf = float("-inf")
        m_z = tl.full([], neg_inf, tl.float32)
        s_z = tl.zeros([], tl.float32)
        m_t = tl.full([], neg_inf, tl.float32)
        s_t = tl.zeros([], tl.float32)
        qz = tl.zeros([], tl.float32)  # sum exp(t - m_t) z, rescaled as m_t grows: sum q z = qz / s_t
        best_z = tl.zeros([], tl.int64)
        best_t = tl.zeros([], tl.int64)
        # Pass 1: online softmax of both rows, sum q.z and both argmaxes (first index on ties, as torch).
        for start in range(0, V, BLOCK_V):
            idx = start + cols
            inside = idx < V
            z = tl.load(z_row + idx, mask=inside, other=neg_inf).to(tl.float32)
            t = tl.load(t_row + idx, mask=inside, other=neg_inf).to(tl.float32)
            bz = tl.max(z, 0)
            bt = tl.max(t, 0)
            best_z = tl.where(bz > m_z, start + tl.argmax(z, 0).to(tl.int64), best_z)
            best_t = tl.where(bt > m_t, start + tl.argmax(t, 0).to(tl.int64), best_t)
            new_m_z = tl.maximum(m_z, bz)
            s_z = s_z * tl.exp(m_z - new_m_z) + tl.sum(tl.exp(z - new_m_z), 0)
            m_z = new_m_z
            new_m_t = tl.maximum(m_t, bt)
            w = tl.exp(t - new_m_t)
            rescale = tl.exp(m_t - new_m_t)
            s_t = s_t * rescale + tl.sum(w, 0)
            qz = qz * rescale + tl.sum(w * tl.where(inside, z, 0.0), 0)  # w is 0 outside V
            m_t = new_m_t
        lse_z = m_z + tl.log(s_z)
        lse_t = m_t + tl.log(s_t)
        tl.store(lse_z_ptr + row, lse_z)
        tl.store(lse_t_ptr + row, lse_t)
        tl.store(top1_z_ptr + row, best_z)
        tl.store(top1_t_ptr + row, best_t)
        if SOFT:
            tl.store(loss_ptr + row, lse_z - qz / s_t)  # -sum q log p = lse_z - sum q z
            # Pass 2: expected acceptance sum min(p, q) needs both normalisers, known only now.
            accept = tl.zeros([], tl.float32)
            for start in range(0, V, BLOCK_V):
                idx = start + cols
                inside = idx < V
                z = tl.load(z_row + idx, mask=inside, other=neg_inf).to(tl.float32)
                t = tl.load(t_row + idx, mask=inside, other=neg_inf).to(tl.float32)
                accept += tl.sum(tl.minimum(tl.exp(z - lse_z), tl.exp(t - lse_t)), 0)
            tl.store(accept_ptr + row, accept)
        else:
            label = tl.load(label_ptr + row)
            tl.store(loss_ptr + row, lse_z - tl.load(z_row + label).to(tl.float32))
            tl.store(accept_ptr + row, 0.0)

    @triton.jit
    def _soft_ce_bwd(z_ptr, t_ptr, label_ptr, lse_z_ptr, lse_t_ptr, grad_ptr, V, z_stride, t_stride,
                     SOFT: tl.constexpr, BLOCK_V: tl.constexpr):
        """z <- grad x (softmax(z) - q), in place (z's dtype); grad read on the device (no host sync)."""
        row = tl.program_id(0).to(tl.int64)
        z_row = z_ptr + row * z_stride
        t_row = t_ptr + row * t_stride
        lse_z = tl.load(lse_z_ptr + row)
        grad = tl.load(grad_ptr)
        lse_t = tl.load(lse_t_ptr + row)
        label = tl.load(label_ptr + row)
        cols = tl.arange(0, BLOCK_V)
        for start in range(0, V, BLOCK_V):
            idx = start + cols
            inside = idx < V
            z = tl.load(z_row + idx, mask=inside, other=0.0).to(tl.float32)
            if SOFT:
                q = tl.exp(tl.load(t_row + idx, mask=inside, other=0.0).to(tl.float32) - lse_t)
            else:
                q = tl.where(idx == label, 1.0, 0.0)
            g = grad * (tl.exp(z - lse_z) - q)
            tl.store(z_row + idx, g.to(z_ptr.dtype.element_ty), mask=inside)


BLOCK_V = 2048  # vocab entries per step of a row's walk; V need not be a multiple


def _row_stats(z: torch.Tensor, t: torch.Tensor, labels: torch.Tensor, soft: bool):
    n, V = z.shape
    f32 = dict(dtype=torch.float32, device=z.device)
    loss, lse_z, lse_t, accept = (torch.empty(n, **f32) for _ in range(4))
    top1_z, top1_t = (torch.empty(n, dtype=torch.int64, device=z.device) for _ in range(2))
    if n:
        _soft_ce_fwd[(n,)](z, t, labels, loss, lse_z, lse_t, top1_z, top1_t, accept, V, z.stride(0), t.stride(0),
                           SOFT=soft, BLOCK_V=BLOCK_V)
    return loss, lse_z, lse_t, top1_z, top1_t, accept


class _LinearSoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, teacher: Callable[[torch.Tensor], torch.Tensor],
                teacher_h: torch.Tensor, labels: torch.Tensor, soft: bool, chunk_tokens: int):
        N = x.shape[0]
        losses, lse_zs, lse_ts, correct, top5, accept = [], [], [], [], [], []
        for start in range(0, max(N, 1), chunk_tokens):
            part = slice(start, start + chunk_tokens)
            z = F.linear(x[part], weight).contiguous()  # [n, V]: the only vocab-sized tensor, one chunk's
            t = teacher(teacher_h[part]).contiguous()
            loss, lse_z, lse_t, top1_z, top1_t, acc = _row_stats(z, t, labels[part].contiguous(), soft)
            losses.append(loss)
            lse_zs.append(lse_z)
            lse_ts.append(lse_t)
            correct.append(top1_z == top1_t)
            top5.append((z.topk(min(5, z.shape[-1]), -1).indices == top1_t[:, None]).any(-1))
            accept.append(acc)
        ctx.teacher, ctx.soft, ctx.chunk_tokens = teacher, soft, chunk_tokens
        ctx.save_for_backward(x, weight, teacher_h, labels, torch.cat(lse_zs), torch.cat(lse_ts))
        correct, top5, accept = torch.cat(correct), torch.cat(top5), torch.cat(accept)
        ctx.mark_non_differentiable(correct, top5, accept)
        return torch.cat(losses).sum(), correct, top5, accept

    @staticmethod
    def backward(ctx, grad_loss, *_):
        x, weight, teacher_h, labels, lse_z, lse_t = ctx.saved_tensors
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        g = grad_loss.detach().float().reshape(1)
        for start in range(0, x.shape[0], ctx.chunk_tokens):
            part = slice(start, start + ctx.chunk_tokens)
            z = F.linear(x[part], weight).contiguous()  # recomputed, then overwritten by its gradient
            t = ctx.teacher(teacher_h[part]).contiguous() if ctx.soft else z
            _soft_ce_bwd[(z.shape[0],)](z, t, labels[part].contiguous(), lse_z[part], lse_t[part], g, z.shape[1],
                                        z.stride(0), t.stride(0), SOFT=ctx.soft, BLOCK_V=BLOCK_V)
            if grad_x is not None:
                grad_x[part] = z @ weight
            if grad_w is not None:  # per chunk in the weights' dtype (cuBLAS sums in float32), across chunks in float32
                grad_w += (z.t() @ x[part]).float()
        return grad_x, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None


def fused_linear_loss(x: torch.Tensor, weight: torch.Tensor, teacher: Callable[[torch.Tensor], torch.Tensor],
                      teacher_h: torch.Tensor, labels: torch.Tensor, soft: bool, chunk_tokens: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``chunked_vocab_loss`` for a linear projection ``logits = x @ weight.T`` [N, V], with the Triton kernels:
    summed loss (differentiable in x and weight), and per position the argmax match, the teacher's argmax in
    the draft's top 5, and sum min(p, q) (0 for hard labels)."""
    return _LinearSoftCE.apply(x, weight, teacher, teacher_h, labels, soft, chunk_tokens)
