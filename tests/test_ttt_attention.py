"""The blockwise TTT attention equals the dense one, forward and backward, on any length and block size."""

from __future__ import annotations

import pytest
import torch
from test_eagle3 import random_features, tiny_draft

from headstart.models.ttt_attention import ttt_attention, ttt_attention_dense


def inputs(B: int, T: int, steps: int, seed: int = 0, hd: int = 8):
    g = torch.Generator().manual_seed(seed)
    make = lambda: torch.randn(B, 3, T, hd, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
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
    import headstart.heads.eagle3.module as eagle3

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


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,steps", [(50, 1), (50, 4), (128, 3), (200, 7), (5, 2)])
def test_flex_attention_path_equals_dense(device, T, steps):
    """The flex_attention path (the GPU's) computes the TTT attention, also on lengths padded to its 128-wide
    tiles: on CPU eager (math) flex, forward only (it has no CPU backward); on a GPU compiled, with gradients."""
    from headstart.models.ttt_attention import ttt_attention_flex

    dtype = torch.float64 if device == "cpu" else torch.float32
    grad = device != "cpu"
    q, keys, values = (t.detach().to(device, dtype).requires_grad_(grad) if torch.is_tensor(t) else
                       [x.detach().to(device, dtype).requires_grad_(grad) for x in t] for t in inputs(2, T, steps, seed=T, hd=16))
    dense = ttt_attention_dense(q, keys, values)
    flex = ttt_attention_flex(q, keys, values)
    tol = dict(rtol=1e-5, atol=1e-6) if device == "cpu" else dict(rtol=2e-3, atol=2e-4)  # GPU: TF32 tiles
    torch.testing.assert_close(flex, dense, **tol)
    if grad:
        upstream = torch.randn_like(dense)
        want = torch.autograd.grad(dense, [q, *keys, *values], upstream)
        got = torch.autograd.grad(flex, [q, *keys, *values], upstream)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **tol)


def test_flex_block_mask_is_the_ttt_mask():
    """Element by element: causal over step 0's keys, the own position over each later step's."""
    from torch.nn.attention.flex_attention import create_mask

    from headstart.models.ttt_attention import _ttt_block_mask

    T, steps = 256, 3
    mask = create_mask(_ttt_block_mask(T, steps, "cpu").mask_mod, None, None, T, T * steps, device="cpu")[0, 0]
    want = torch.cat([torch.ones(T, T).tril()] + [torch.eye(T)] * (steps - 1), dim=1).bool()
    assert torch.equal(mask, want)
    block = _ttt_block_mask(T, steps, "cpu")
    # Per 128-row query block: the causal diagonal tile of step 0 plus one diagonal tile per later step are
    # partial; step 0's tiles below the diagonal are full; nothing else is computed (T x T never is).
    assert block.kv_num_blocks[0, 0].tolist() == [steps, steps]
    assert block.full_kv_num_blocks[0, 0].tolist() == [0, 1]
    assert sorted(block.kv_indices[0, 0, 1, :steps].tolist()) == [1, 3, 5]  # kv tiles 1 (step 0), 3, 5 (steps 1, 2)
    # the tiles computed are exactly those where the mask has a true entry
    tiles = want.reshape(T // 128, 128, steps * T // 128, 128).any(-1).any(1)
    assert torch.equal(block.to_dense()[0, 0].bool(), tiles)
