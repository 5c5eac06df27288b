"""The training divergences of ``draft.loss`` (models/vocab_loss.py ``divergence_sum``): their values, that a step
on each moves the draft toward the target, and that every head trains with them."""

from __future__ import annotations

import math

import pytest
import torch
from trainer_fixtures import make_setup, train_losses

from headstart.models.head import DIVERGENCES
from headstart.models.vocab_loss import chunked_vocab_loss, divergence_sum
from headstart.trainer.config import load_config
from headstart.trainer.run import build_trainer


def distributions(n: int = 6, V: int = 11, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, V, generator=g) * 2).log_softmax(-1), (torch.randn(n, V, generator=g) * 2).log_softmax(-1)


def test_each_divergence_is_its_formula():
    logp, logq = distributions()
    p, q = logp.exp(), logq.exp()
    alpha = torch.minimum(p, q).sum(-1)
    m = (p + q) / 2
    kl = lambda a, b: (a * (a.log() - b.log())).sum()  # noqa: E731
    expected = {"kl": -(p * logq).sum(), "rkl": kl(q, p), "jsd": 0.5 * kl(p, m) + 0.5 * kl(q, m),
                "tv": (1 - alpha).sum(), "lk": -alpha.log().sum()}
    assert set(expected) == set(DIVERGENCES)
    for name, value in expected.items():
        torch.testing.assert_close(divergence_sum(name, logp, logq), value, rtol=1e-5, atol=1e-6, msg=name)
    # Each is zero (kl: p's entropy, its constant) where the draft equals the target.
    entropy = -(p * logp).sum()
    for name in DIVERGENCES:
        torch.testing.assert_close(divergence_sum(name, logp, logp), entropy if name == "kl" else torch.tensor(0.0),
                                   atol=1e-5, rtol=1e-5, msg=name)
    assert divergence_sum("lk", logp, torch.full_like(logp, -1e4).log_softmax(-1)).isfinite()


@pytest.mark.parametrize("name", DIVERGENCES)
def test_gradient_steps_on_each_divergence_raise_the_acceptance_rate(name):
    logp, _ = distributions(seed=1)
    logits = torch.randn(logp.shape, generator=torch.Generator().manual_seed(2)).requires_grad_()
    alpha = lambda: torch.minimum(logp.exp(), logits.softmax(-1)).sum(-1).mean()  # noqa: E731
    before = float(alpha())
    optimizer = torch.optim.SGD([logits], lr=0.5)
    for _ in range(50):
        optimizer.zero_grad()
        divergence_sum(name, logp, logits.log_softmax(-1)).backward()
        optimizer.step()
    assert float(alpha()) > before + 0.1


def test_the_loss_of_the_chunked_path_is_the_divergence_and_hard_labels_refuse_one():
    logp, _ = distributions(n=5, V=7, seed=3)
    weight = torch.randn(7, 4, generator=torch.Generator().manual_seed(4))
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(5))
    rows = torch.arange(5)
    loss, *_ = chunked_vocab_loss(lambda h: h @ weight.T, x, lambda r: logp[r], rows, rows, soft=True, chunk_tokens=2,
                                  divergence="lk")
    torch.testing.assert_close(loss, divergence_sum("lk", logp, (x @ weight.T).log_softmax(-1)))
    with pytest.raises(ValueError, match="draft.loss='jsd' compares the draft with the target's distribution"):
        chunked_vocab_loss(lambda h: h @ weight.T, x, lambda r: logp[r], rows, rows, soft=False, chunk_tokens=2,
                           divergence="jsd")


@pytest.mark.parametrize("soft", [True, False])
def test_weighted_chunks_sum_each_positions_loss_times_its_weight(soft):
    """``weights`` (DFlash's D-PACE): the chunked loss is sum_i w_i loss_i, soft and hard labels alike."""
    logp, _ = distributions(n=5, V=7, seed=3)
    weight = torch.randn(7, 4, generator=torch.Generator().manual_seed(4))
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(5))
    rows, labels = torch.arange(5), torch.tensor([0, 3, 6, 2, 2])
    w = torch.tensor([0.0, 1.0, 2.5, 0.5, 3.0])

    def loss(rows_, weights=None):
        return chunked_vocab_loss(lambda h: h @ weight.T, x[rows_], lambda r: logp[r], rows_, labels[rows_], soft=soft,
                                  chunk_tokens=2, divergence="kl", weights=weights)[0]

    alone = torch.stack([loss(rows[i : i + 1]) for i in range(5)])
    torch.testing.assert_close(loss(rows, w), (alone * w).sum())
    torch.testing.assert_close(loss(rows, torch.ones(5)), loss(rows))


def test_an_unknown_divergence_is_refused_by_name():
    with pytest.raises(ValueError, match="draft.loss='kld' is not one of kl, rkl, jsd, tv, lk"):
        load_config(None, ["--draft.loss=kld"])


@pytest.mark.parametrize("head,loss", [("eagle3", "lk"), ("eagle3", "jsd"), ("mtp", "rkl"), ("medusa", "tv")])
def test_every_head_trains_with_another_divergence(tmp_path, head, loss):
    """A few steps of a tiny run: the loss is that divergence (lk starts near -log of a small overlap) and falls."""
    overrides = make_setup(tmp_path, head=head) + [f"--draft.loss={loss}", "--train.max_steps=6", "--train.lr=3e-3"]
    if head == "eagle3":
        overrides.append("--draft.feature_noise=0.05")
    trainer = build_trainer(load_config(None, overrides))
    trainer.train()
    losses = train_losses(tmp_path / "run" / "metrics.jsonl")
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
