"""The blockwise TTT attention equals the dense one, forward and backward, on any length and block size."""

from __future__ import annotations

import pytest
import torch
from test_eagle3 import random_features, tiny_draft

from headstart.models.ttt_attention import ttt_attention, ttt_attention_dense


def inputs(B: int, T: int, steps: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    make = lambda: torch.randn(B, 3, T, 8, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    return make(), [make() for _ in range(steps)], [make() for _ in range(steps)]


@pytest.mark.parametrize("T,block,steps", [(50, 16, 1), (50, 16, 4), (64, 16, 3), (7, 3, 2), (33, 32, 7), (5, 16, 2)])
def test_blockwise_equals_dense_forward_and_gradients(T, block, steps):
    q, keys, values = inputs(2, T, steps)
    dense = ttt_attention_dense(q, keys, values)
    upstream = torch.randn_like(dense)
    want = torch.autograd.grad(dense, [q, *keys, *values], upstream)
    blocked = ttt_attention(q, keys, values, block=block)
    got = torch.autograd.grad(blocked, [q, *keys, *values], upstream)
    # float64 inputs, but the softmax runs in float32 in both (as in training): rows of another length sum in
    # another order, so agreement is float32's, not float64's
    torch.testing.assert_close(blocked, dense, rtol=1e-5, atol=1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # the dense form mixes in the diagonal keys: a step's own-position key moves its row's output
    if steps > 1:
        moved = [k.detach().clone() for k in keys]
        moved[1][:, :, T // 2] += 1.0
        changed = (ttt_attention(q.detach(), moved, [v.detach() for v in values], block) - dense.detach()).abs().sum((0, 1, 3))
        assert (changed > 1e-3).nonzero().flatten().tolist() == [T // 2]  # that row only (others: float noise)


def test_the_draft_loss_and_its_gradients_do_not_depend_on_blocks_chunks_or_recomputation(monkeypatch):
    import headstart.models.eagle3 as eagle3

    draft = tiny_draft(ttt_steps=4)
    f = random_features(draft, B=2, T=23)  # row 1 ends in padding
    results = []
    # (attention block, loss chunk, recompute threshold): dense and kept; blockwise; chunked and recomputed
    for block, chunk, recompute_above in ((10**6, 10**6, 2**62), (5, 10**6, 2**62), (8, 3, 0), (10**6, 7, 0)):
        draft.midlayer.self_attn.block, draft.chunk_tokens = block, chunk
        monkeypatch.setattr(eagle3, "RECOMPUTE_ABOVE", recompute_above)
        draft.zero_grad()
        loss, _ = draft.loss(f)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}))
    (ref_loss, ref_grads), *others = results
    for loss, grads in others:
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
