"""The fused Triton vocab loss (models/fused_loss.py) against the PyTorch chunked loss: loss, metrics and
gradients. On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py); on a GPU, compiled."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from test_eagle3 import random_features, tiny_draft  # noqa: E402
from test_medusa import batch, heads_for  # noqa: E402
from tiny_models import tiny_causal_lm  # noqa: E402

from headstart.models import fused_loss  # noqa: E402
from headstart.models.target import Target  # noqa: E402
from headstart.models.vocab_loss import VocabProjection, chunked_vocab_loss, use_fused  # noqa: E402

# The kernels on CPU tensors under the interpreter (no GPU: tests/conftest.py), compiled on a GPU.
DEVICES = (["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []) + (["cuda"] if torch.cuda.is_available() else [])
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the heads' tests


def _case(N: int, D: int, V: int, seed: int, device: str, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(V, D, generator=g) * 0.3).to(device, dtype).requires_grad_()
    rows = torch.randperm(N + 3, generator=g)[:N]  # the teacher's rows, gathered as EAGLE-3 does
    teacher_logits = torch.randn(N + 3, V, generator=g) * 2
    # Half the rows close to the draft's own logits, so the argmaxes agree on some and not on others.
    close = torch.arange(N) % 2 == 0
    teacher_logits[rows[close]] = 3 * (x.detach().cpu().float() @ w.detach().cpu().float().t())[close] + 0.1 * teacher_logits[rows[close]]
    teacher_logits, rows = teacher_logits.to(device, dtype), rows.to(device)
    labels = torch.randint(0, V, (N,), generator=g).to(device)
    return x, w, (lambda r: teacher_logits[r]), rows, labels


def _run(fused: bool, x, w, teacher, rows, labels, soft: bool, chunk: int):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    if fused:
        out = fused_loss.fused_linear_loss(x, w, teacher, rows, labels, soft, chunk)
    else:  # a plain function: chunked_vocab_loss's PyTorch path
        out = chunked_vocab_loss(lambda v: (v @ w.t()).float(), x, teacher, rows, labels, soft, chunk)
    (out[0] * 0.7).backward()  # a non-unit upstream gradient, as the step weights give
    return out, x.grad, w.grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N,D,V,chunk,soft", [
    (37, 24, 3000, 16, True),    # V not a multiple of the kernel's 2048-wide block; rows across chunks
    (9, 16, 100, 4, True),       # V smaller than one block
    (12, 8, 2049, 64, False),    # hard labels; one entry past a block
    (0, 8, 50, 4, True),         # a rank with no trained position still gives (zero) gradients
])
def test_fused_loss_equals_the_pytorch_loss(device, N, D, V, chunk, soft):
    case = _case(N, D, V, seed=N + V, device=device)
    (loss, correct, top5, accept), gx, gw = _run(True, *case, soft, chunk)
    (ref_loss, ref_correct, ref_top5, ref_accept), ref_gx, ref_gw = _run(False, *case, soft, chunk)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-4)
    assert torch.equal(correct, ref_correct) and torch.equal(top5, ref_top5)
    torch.testing.assert_close(accept, ref_accept, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, ref_gx, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gw, ref_gw, rtol=1e-4, atol=1e-5)
    if N:
        assert 0 < correct.float().mean() < 1  # cases where the argmax comparison goes either way
        assert loss.item() > 0 and gw.abs().sum() > 0


@pytest.mark.parametrize("device", DEVICES)
def test_loss_is_the_soft_cross_entropy_by_hand(device):
    x, w, teacher, rows, labels = _case(6, 8, 300, seed=3, device=device)
    loss, correct, _, accept = fused_loss.fused_linear_loss(x, w, teacher, rows, labels, True, 4)
    p = torch.softmax(teacher(rows), -1)
    logq = torch.log_softmax(x @ w.t(), -1)
    torch.testing.assert_close(loss, -(p * logq).sum(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(accept, torch.minimum(p, logq.exp()).sum(-1), rtol=1e-5, atol=1e-6)
    assert torch.equal(correct, (x @ w.t()).argmax(-1) == teacher(rows).argmax(-1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 through the compiled kernels needs a GPU")
def test_fused_loss_in_bf16_on_gpu_is_as_close_as_the_pytorch_loss():
    """In bf16 both paths round (logits, gradients); the kernels' error against float32 must be no worse than the
    PyTorch path's in bf16."""
    case = _case(300, 256, 32000, seed=0, device="cuda", dtype=torch.bfloat16)
    (loss, *_), gx, gw = _run(True, *case, True, 128)
    (bf_loss, *_), bf_gx, bf_gw = _run(False, *case, True, 128)
    f32 = [t.float() if torch.is_tensor(t) and t.is_floating_point() else t for t in case]
    f32[2] = lambda r, t=case[2]: t(r).float()
    (ref_loss, *_), ref_gx, ref_gw = _run(False, *f32, True, 128)
    err = lambda a, b: ((a.float() - b).norm() / b.norm()).item()  # noqa: E731
    assert abs(loss.item() - ref_loss.item()) <= 1.5 * abs(bf_loss.item() - ref_loss.item()) + 1e-3 * abs(ref_loss.item())
    assert err(gx, ref_gx) <= 1.5 * err(bf_gx, ref_gx) + 1e-3
    assert err(gw, ref_gw) <= 1.5 * err(bf_gw, ref_gw) + 1e-3


def _grads(module: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    module.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _both_kernels(monkeypatch, run):
    """run() with the PyTorch loss, then with the kernels -- checking that the kernels did run the second time."""
    import headstart.models.vocab_loss as vocab_loss

    calls = []
    fused = vocab_loss.fused_linear_loss
    monkeypatch.setattr(vocab_loss, "fused_linear_loss", lambda *a: calls.append(1) or fused(*a))
    out = {}
    for kernel in ("torch", "triton"):
        monkeypatch.setenv("HEADSTART_LOSS_KERNEL", kernel)
        out[kernel] = run()
        assert bool(calls) == (kernel == "triton"), kernel
    return out["torch"], out["triton"]


def _head_is_the_same_through_the_kernels(monkeypatch, head: torch.nn.Module, f) -> dict[str, torch.Tensor]:
    """The head's loss, metrics and every parameter gradient, PyTorch loss against the kernels; the gradients."""
    def run():
        loss, metrics = head.loss(f)
        return loss.item(), metrics, _grads(head, loss)

    (ref_loss, ref_metrics, ref_grads), (loss, metrics, grads) = _both_kernels(monkeypatch, run)
    assert abs(loss - ref_loss) < 1e-5 * abs(ref_loss)
    for key, value in ref_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert set(grads) == set(ref_grads)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    return grads


def test_eagle3_head_loss_and_gradients_are_the_same_through_the_kernels(monkeypatch):
    draft = tiny_draft(ttt_steps=3, draft_vocab=48)
    f = random_features(draft, B=3, T=12)  # padded rows, untrained positions
    f.target_in_draft[0, :4] = False
    draft, f = draft.to(DEVICE), f.to(DEVICE)
    draft.chunk_tokens = 5  # several chunks per step
    _head_is_the_same_through_the_kernels(monkeypatch, draft, f)


def test_medusa_loss_and_gradients_are_the_same_through_the_kernels(monkeypatch):
    target = Target(tiny_causal_lm("llama", num_hidden_layers=8))
    heads = heads_for(target, num_heads=2)
    f = batch(target).to(DEVICE)
    target.model.to(DEVICE)
    heads.to(DEVICE).set_teacher(target.vocab_head())
    heads.chunk_tokens = 7
    assert "lm_heads.0.weight" in _head_is_the_same_through_the_kernels(monkeypatch, heads, f)


def test_kernel_choice(monkeypatch):
    x = torch.zeros(2, 4, device=DEVICE)
    projection = VocabProjection(lambda v: v, torch.zeros(3, 4, device=DEVICE))
    monkeypatch.delenv("HEADSTART_LOSS_KERNEL", raising=False)
    assert use_fused(projection, x) == (DEVICE == "cuda")  # auto: the kernels on a GPU, PyTorch on CPU
    assert not use_fused(projection, x.cpu())  # auto never interprets
    assert not use_fused(lambda v: v, x)  # an opaque projection cannot be fused
    monkeypatch.setenv("HEADSTART_LOSS_KERNEL", "triton")
    assert use_fused(projection, x)
    monkeypatch.setenv("HEADSTART_LOSS_KERNEL", "fast")
    with pytest.raises(ValueError, match="HEADSTART_LOSS_KERNEL='fast'"):
        use_fused(projection, x)


def test_mtp_loss_and_gradients_are_the_same_through_the_kernels(monkeypatch):
    """MTP projects with the target's own (frozen) lm_head over the full vocab: fused when it is a plain linear."""
    from test_mtp import features, randomized

    from headstart.heads.mtp.module import build_mtp

    target = Target(tiny_causal_lm("llama", num_hidden_layers=8))
    head = randomized(build_mtp(target, unroll=2, chunk_tokens=6))
    f = features(target).to(DEVICE)
    target.model.to(DEVICE)
    head.to(DEVICE).set_lm_head(target.vocab_head(), target.lm_head_weight.dtype)
    assert head.lm_head.linear_weight is not None
    assert "eh_proj.weight" in _head_is_the_same_through_the_kernels(monkeypatch, head, f)


def test_a_softcapped_lm_head_is_not_fused():
    from headstart.models.target import vocab_head

    w = torch.randn(5, 3)
    assert vocab_head(w, None, None).linear_weight is w
    assert vocab_head(w, None, 30.0).linear_weight is None  # Gemma's softcap: not a linear projection
    assert vocab_head(w, torch.zeros(5), None).linear_weight is None
