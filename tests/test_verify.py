"""Chain verification: greedy equals argmax decoding; rejection sampling preserves the target's law."""

from __future__ import annotations

import pytest
import torch

from headstart.decode.verify import verify_greedy, verify_sampling, warp_probs

V = 6
CHI2_DF5_P999 = 20.52  # chi-square critical value, 5 degrees of freedom, p = 0.001


def one_hot_logits(tokens: list[int]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()[None] * 5  # [1, len, V]


def test_greedy_prefix_and_bonus():
    # target argmax along the chain: 3 1 4 | bonus 5
    logits = one_hot_logits([3, 1, 4, 5])
    cases = {(3, 1, 4): (3, 5), (3, 1, 0): (2, 4), (2, 1, 4): (0, 3), (3, 0, 4): (1, 1)}
    for draft, (n, nxt) in cases.items():
        accepted, next_token = verify_greedy(torch.tensor([draft]), logits)
        assert (accepted.item(), next_token.item()) == (n, nxt), draft
    batch = torch.tensor([[3, 1, 4], [2, 1, 4]])
    accepted, next_token = verify_greedy(batch, logits.expand(2, -1, -1))
    assert accepted.tolist() == [3, 0] and next_token.tolist() == [5, 3]


def chi2(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=V).double()
    expected = probs.double() * samples.numel()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def run_rounds(p: torch.Tensor, q: torch.Tensor, n: int, seed: int, q_for_acceptance: torch.Tensor | None = None):
    g = torch.Generator().manual_seed(seed)
    k = q.shape[0]
    drafts = torch.stack([torch.multinomial(q[i].expand(n, V), 1, replacement=True, generator=g).squeeze(1)
                          for i in range(k)], dim=1)  # [n, k], each position sampled from q_i
    q_used = q if q_for_acceptance is None else q_for_acceptance
    return drafts, *verify_sampling(drafts, q_used.expand(n, k, V), p.expand(n, k + 1, V), generator=g)


P = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.10, 0.00],
                  [0.05, 0.05, 0.50, 0.20, 0.10, 0.10],
                  [0.30, 0.30, 0.10, 0.10, 0.10, 0.10]])
Q = torch.tensor([[0.10, 0.50, 0.10, 0.10, 0.10, 0.10],
                  [0.20, 0.20, 0.20, 0.20, 0.10, 0.10]])


def test_rejection_sampling_preserves_the_target_distribution():
    n = 200_000
    drafts, accepted, next_token = run_rounds(P, Q, n, seed=0)
    first = torch.where(accepted >= 1, drafts[:, 0], next_token)
    assert chi2(first, P[0]) < CHI2_DF5_P999
    # Given the first draft was accepted, the second emitted token follows p_1.
    kept = accepted >= 1
    second = torch.where(accepted[kept] >= 2, drafts[kept, 1], next_token[kept])
    assert chi2(second, P[1]) < CHI2_DF5_P999
    # Acceptance rate of the first draft is sum_x min(p, q) (Leviathan et al., eq. 1).
    assert (accepted >= 1).double().mean().item() == pytest.approx(torch.minimum(P[0], Q[0]).sum().item(), abs=0.005)


def test_a_wrong_acceptance_rule_is_detected():
    # Accepting with probability p(x) (ignoring q) biases the output: the test statistic must explode.
    drafts, accepted, next_token = run_rounds(P, Q, 200_000, seed=1, q_for_acceptance=torch.ones_like(Q))
    first = torch.where(accepted >= 1, drafts[:, 0], next_token)
    assert chi2(first, P[0]) > 50 * CHI2_DF5_P999


def test_identical_draft_is_always_accepted():
    drafts, accepted, next_token = run_rounds(P, P[:2], 5_000, seed=2)
    assert (accepted == 2).all()
    assert chi2(next_token, P[2]) < CHI2_DF5_P999  # the bonus token comes from p at position k


def test_no_drafts_samples_the_next_token_from_p():
    g = torch.Generator().manual_seed(4)
    n = 20_000
    accepted, next_token = verify_sampling(torch.empty(n, 0, dtype=torch.long), torch.empty(n, 0, V),
                                           P[:1].expand(n, 1, V), generator=g)
    assert (accepted == 0).all() and chi2(next_token, P[0]) < CHI2_DF5_P999


def test_warp_probs():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    assert torch.allclose(warp_probs(logits), torch.softmax(logits, -1))
    top2 = warp_probs(logits, top_k=2)
    assert (top2[2:] == 0).all() and top2[:2].sum().item() == pytest.approx(1.0)
    full = torch.softmax(logits, -1)
    nucleus = warp_probs(logits, top_p=0.8)
    kept = int((nucleus > 0).sum())
    assert full[: kept - 1].sum() < 0.8 <= full[:kept].sum()  # the smallest prefix reaching top_p
    cold = warp_probs(logits, temperature=0.5)
    assert cold[0] > full[0]
    with pytest.raises(ValueError, match="temperature must be > 0"):
        warp_probs(logits, temperature=0)
