"""Block verification (decode/verify.py ``verify_block``): exact against the target's law, never fewer tokens kept in
expectation than token verification, and its sampler draws what ``block_acceptance`` says.

The exact checks enumerate every draft block of a small world whose target and draft distributions depend on the whole
prefix (so a rule that forgot the context after a draft would show), and compute what one round emits, completed by the
target to a fixed length: lossless means that equals the target's own joint.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from headstart.decode.verify import block_acceptance, verify_block, verify_sampling

V, K = 3, 3


def world(seed: int, one_hot_q: bool = False, equal: bool = False):
    """p(.|prefix) and q(.|prefix) for every prefix of up to K tokens: dicts of tuple -> [V]. ``one_hot_q``: a
    deterministic drafter (q a point mass); ``equal``: the draft is the target (p == q, every weight 1)."""
    g = torch.Generator().manual_seed(seed)
    p, q = {}, {}
    for n in range(K + 1):
        for prefix in itertools.product(range(V), repeat=n):
            p[prefix] = torch.softmax(torch.randn(V, generator=g) * 2, 0).double()
            if one_hot_q:
                q[prefix] = torch.nn.functional.one_hot(torch.randint(V, (1,), generator=g), V)[0].double()
            else:
                q[prefix] = p[prefix].clone() if equal else torch.softmax(torch.randn(V, generator=g) * 2, 0).double()
    return p, q


def blocks(p, q):
    """Every draft block X (its probability under q) with the tensors a chain round hands the verifier."""
    out = []
    for x in itertools.product(range(V), repeat=K):
        prob = math.prod(float(q[x[:i]][x[i]]) for i in range(K))
        if prob == 0:
            continue
        draft_probs = torch.stack([q[x[:i]] for i in range(K)])  # [K, V]
        target_probs = torch.stack([p[x[:i]] for i in range(K + 1)])  # [K+1, V]
        out.append((x, prob, draft_probs, target_probs))
    return out


def target_joint(p, length: int) -> dict[tuple, float]:
    return {s: math.prod(float(p[s[:i]][s[i]]) for i in range(length)) for s in itertools.product(range(V), repeat=length)}


def completed(p, emitted: dict[tuple, float], length: int) -> dict[tuple, float]:
    """The law of ``length`` tokens: a round's emitted prefix, then the target's own sampling."""
    out = dict.fromkeys(itertools.product(range(V), repeat=length), 0.0)
    for s in out:
        for prefix, mass in emitted.items():
            if s[: len(prefix)] == prefix:
                out[s] += mass * math.prod(float(p[s[:i]][s[i]]) for i in range(len(prefix), length))
    return out


def block_round_law(p, q) -> tuple[dict[tuple, float], float]:
    """What one block-verified round emits (prefix -> probability), exactly, and its expected kept drafts."""
    emitted: dict[tuple, float] = {}
    kept = 0.0
    for x, prob, dq, dp in blocks(p, q):
        _, h, residual = block_acceptance(torch.tensor([x]), dq[None], dp[None])
        h, residual = h[0].double(), residual[0].double()
        for tau in range(K + 1):  # the longest i whose uniform falls under h_i; 0 where none does
            p_tau = (h[tau - 1] if tau else 1.0) * torch.prod(1 - h[tau:])
            if p_tau == 0:
                continue
            kept += prob * float(p_tau) * tau
            r = residual[tau]
            r = r / r.sum() if r.sum() > 0 else dp[tau]
            for y in range(V):
                key = x[:tau] + (y,)
                emitted[key] = emitted.get(key, 0.0) + prob * float(p_tau) * float(r[y])
    return emitted, kept


def token_round_kept(p, q) -> float:
    """Token verification's expected kept drafts: the sum over i of P(the first i drafts all pass)."""
    kept = 0.0
    for x, prob, dq, dp in blocks(p, q):
        passed = 1.0
        for i in range(K):
            passed *= min(1.0, float(dp[i][x[i]] / dq[i][x[i]]))
            kept += prob * passed
    return kept


@pytest.mark.parametrize("case", ["sampled", "one-hot", "equal"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_block_verified_round_emits_the_target_law_exactly(case, seed):
    p, q = world(seed, one_hot_q=case == "one-hot", equal=case == "equal")
    emitted, _ = block_round_law(p, q)
    assert sum(emitted.values()) == pytest.approx(1.0, abs=1e-6)
    law, want = completed(p, emitted, K + 1), target_joint(p, K + 1)
    assert max(abs(law[s] - want[s]) for s in want) < 1e-6


@pytest.mark.parametrize("seed", range(6))
def test_block_verification_keeps_at_least_what_token_verification_keeps(seed):
    p, q = world(seed)
    _, block = block_round_law(p, q)
    token = token_round_kept(p, q)
    assert block >= token - 1e-9
    if seed == 0:  # and strictly more on a generic world: the rule is not token verification renamed
        assert block > token + 1e-3


def test_the_draft_equal_to_the_target_keeps_every_draft():
    p, q = world(0, equal=True)
    _, kept = block_round_law(p, q)
    assert kept == pytest.approx(K, abs=1e-6)


def test_a_forgotten_context_is_caught():
    """The exact check fails for a rule that is not lossless: the target's context after draft 1 replaced by the
    prompt's (the check can fail)."""
    p, q = world(0)
    emitted: dict[tuple, float] = {}
    for x, prob, dq, dp in blocks(p, q):
        wrong = dp.clone()
        wrong[1:] = dp[0]
        _, h, residual = block_acceptance(torch.tensor([x]), dq[None], wrong[None])
        for tau in range(K + 1):
            p_tau = float((h[0, tau - 1] if tau else 1.0) * torch.prod(1 - h[0, tau:]))
            r = residual[0, tau] / residual[0, tau].sum()
            for y in range(V):
                emitted[x[:tau] + (y,)] = emitted.get(x[:tau] + (y,), 0.0) + prob * p_tau * float(r[y])
    law, want = completed(p, emitted, K + 1), target_joint(p, K + 1)
    assert max(abs(law[s] - want[s]) for s in want) > 1e-3


def test_the_sampler_draws_the_kept_length_and_next_token_block_acceptance_gives():
    """verify_block on one block repeated 200,000 times: the (kept, next token) counts against the exact law of h and
    the residuals, by chi-square (p = 0.001)."""
    p, q = world(4)
    x = (1, 0, 2)
    dq = torch.stack([q[x[:i]] for i in range(K)]).float()
    dp = torch.stack([p[x[:i]] for i in range(K + 1)]).float()
    n = 200_000
    accepted, nxt = verify_block(torch.tensor([x]).expand(n, K), dq.expand(n, K, V), dp.expand(n, K + 1, V),
                                 generator=torch.Generator().manual_seed(0))
    _, h, residual = block_acceptance(torch.tensor([x]), dq[None], dp[None])
    h, residual = h[0].double(), residual[0].double()
    expected = torch.zeros(K + 1, V, dtype=torch.float64)
    for tau in range(K + 1):
        r = residual[tau] / residual[tau].sum()
        expected[tau] = (h[tau - 1] if tau else 1.0) * torch.prod(1 - h[tau:]) * r
    counts = torch.zeros(K + 1, V, dtype=torch.float64)
    counts.index_put_((accepted, nxt), torch.ones(n, dtype=torch.float64), accumulate=True)
    big = expected * n >= 5
    assert counts[~big].sum() <= max(25.0, 3 * float(expected[~big].sum() * n))
    stat = float(((counts[big] - expected[big] * n) ** 2 / (expected[big] * n)).sum())
    df = int(big.sum()) - 1
    critical = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3  # Wilson-Hilferty, p = 0.001
    assert stat < critical


def test_padding_is_never_kept_and_a_short_row_ends_at_its_own_length():
    """A batch pads shorter chains (q = 0 there): a row of 1 real draft keeps at most 1, and its next token after a
    kept draft comes from the target's distribution there (weight x p, no q: the draft ended)."""
    p, q = world(5)
    x = (2, 1, 0)
    dq = torch.stack([q[x[:i]] for i in range(K)]).float()
    dp = torch.stack([p[x[:i]] for i in range(K + 1)]).float()
    n = 20_000
    dq_padded = dq.clone()
    dq_padded[1:] = 0
    accepted, nxt = verify_block(torch.tensor([x]).expand(n, K), dq_padded.expand(n, K, V), dp.expand(n, K + 1, V),
                                 generator=torch.Generator().manual_seed(1), lengths=torch.ones(n, dtype=torch.long))
    assert accepted.max() <= 1
    ratio = min(1.0, float(dp[0][x[0]] / dq[0][x[0]]))  # one draft: block verification is token verification
    assert abs(float((accepted == 1).double().mean()) - ratio) < 4 * math.sqrt(ratio * (1 - ratio) / n) + 1e-9
    token = verify_sampling(torch.tensor([x[:1]]).expand(n, 1), dq[:1].expand(n, 1, V), dp[:2].expand(n, 2, V),
                            generator=torch.Generator().manual_seed(1))
    for kept in (0, 1):  # the same next-token law as a 1-draft chain's token verification
        a = torch.bincount(nxt[accepted == kept], minlength=V).double()
        b = torch.bincount(token[1][token[0] == kept], minlength=V).double()
        assert torch.allclose(a / a.sum(), b / b.sum(), atol=0.03)


def test_the_flag_is_refused_by_name_where_it_has_no_meaning_and_named_in_the_run_mode(capsys):
    from headstart.decode.report import run_mode
    from headstart.decode.verify import Verification
    from headstart.scripts.benchmark import build_parser, check_args

    base = ["--target", "t", "--questions", "q", "--out", "o", "--method", "eagle3", "--draft", "d"]
    p = build_parser()
    for extra, says in ((["--verification", "block"], "verifies sampled drafts: it needs --temperature > 0"),
                        (["--verification", "block", "--temperature", "0.7", "--tree"], "verifies a chain")):
        with pytest.raises(SystemExit):
            check_args(p, p.parse_args(base + extra))
        assert f"--verification block {says}" in capsys.readouterr().err
    args = p.parse_args(base + ["--verification", "block", "--temperature", "0.7"])
    check_args(p, args)
    assert run_mode(args, "float32", "float32") == "sampling T=0.7 top-p 1.0 top-k 0, block verification"
    with pytest.raises(ValueError, match="a tree is verified node by node"):
        Verification("block").check(tree=True)
    with pytest.raises(ValueError, match="unknown verification 'blocks'"):
        Verification("blocks")


def test_a_round_with_no_drafts_samples_the_next_token_from_the_target():
    """The last rounds of a request draft nothing (the length limit): the rule then draws from p, as token
    verification does."""
    p = torch.tensor([[[0.0, 1.0, 0.0]]]).expand(5, 1, 3)
    accepted, nxt = verify_block(torch.zeros(5, 0, dtype=torch.long), torch.zeros(5, 0, 3), p)
    assert accepted.tolist() == [0] * 5 and nxt.tolist() == [1] * 5
