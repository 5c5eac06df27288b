"""Typical acceptance (decode/typical.py): Medusa-2's rule as written, its trees keep the deepest typical node, it is
caught as not lossless by the chi-square test that passes the lossless rules, and the quality it costs is measured."""

from __future__ import annotations

import math

import pytest
import torch
from test_sampling_loop import SAMPLING, chi2_vs, exact_joint, sample_pairs, world  # noqa: F401 (world: the fixture)

from headstart.decode.generate import speculative_generate
from headstart.decode.quality import text_logprob
from headstart.decode.tree import DraftTree, verify_tree
from headstart.decode.typical import typical, verify_typical
from headstart.decode.verify import Verification
from headstart.heads.eagle3.drafter import Eagle3Drafter

SURE = torch.tensor([0.90, 0.05, 0.03, 0.02])  # entropy 0.43: bar min(0.09, 0.3 * 0.65) = 0.09
UNSURE = torch.tensor([0.25, 0.25, 0.25, 0.25])  # entropy log 4: bar min(0.09, 0.3 / 4) = 0.075


def test_the_bar_is_the_smaller_of_the_threshold_and_alpha_times_exp_minus_entropy():
    entropy = -(SURE * SURE.log()).sum()
    assert min(0.09, 0.3 * math.exp(-entropy)) == pytest.approx(0.09)
    probs = torch.stack([SURE, SURE, UNSURE, UNSURE])
    # a 0.05 token fails the sure bar (0.09); every 0.25 token clears the unsure bar (0.075); so does the sure argmax
    assert typical(probs, torch.tensor([0, 1, 2, 3]), 0.09, 0.3).tolist() == [True, False, True, True]
    # a lower alpha lowers the unsure bar only; a threshold under 0.05 lets the sure distribution's 0.05 token pass
    assert typical(probs, torch.tensor([1, 1, 1, 1]), 0.04, 0.3).tolist() == [True, True, True, True]


def test_a_chain_keeps_its_longest_typical_prefix_then_the_targets_argmax():
    target = torch.stack([UNSURE, SURE, SURE, torch.tensor([0.1, 0.2, 0.6, 0.1])])[None]  # [1, k+1 = 4, V]
    accepted, nxt = verify_typical(torch.tensor([[3, 0, 1]]), target, 0.09, 0.3)
    assert (accepted.item(), nxt.item()) == (2, 0)  # 3 typical, 0 typical, 1 (p 0.05) not: then SURE's argmax, 0
    accepted, nxt = verify_typical(torch.tensor([[3, 0, 0]]), target, 0.09, 0.3, lengths=torch.tensor([2]))
    assert (accepted.item(), nxt.item()) == (2, 0)  # padding is never kept


def test_a_tree_keeps_its_deepest_typical_node_where_siblings_both_pass():
    # root -> a (0), b (1); a -> c (2); b -> d (3), e (0). Typical under the parent: a, b, d, e; not c.
    tree = DraftTree(tokens=torch.tensor([0, 1, 2, 3, 0]), parents=torch.tensor([-1, -1, 0, 1, 1]),
                     depths=torch.tensor([1, 1, 2, 2, 2]), max_depth=2)
    kept = torch.tensor([True, True, False, True, True])
    choice = torch.tensor([9, 8, 7, 6, 5, 4])  # the target's argmax at each block position
    block = torch.cat([torch.tensor([42]), tree.tokens])
    path, emitted = verify_tree(tree, choice, block, kept)
    assert path == [0, 2, 4] and emitted == [1, 3, 5]  # b then d (the first of b's kept children), then d's argmax


def test_typical_acceptance_is_caught_as_not_lossless_and_moves_the_texts_likelihood(world):
    """The chi-square test that passes token and block verification (tests/test_sampling_loop.py) fails typical
    acceptance: its greedy next tokens and likelier drafts do not follow the target's law. Its text is likelier under
    the target than plain sampling's, which the quality measure shows."""
    model, runner, head = world
    rule = Verification("typical")
    pairs = sample_pairs(runner, lambda: Eagle3Drafter(head, 32), 200, seed=0, verification=rule)
    stat, critical = chi2_vs(pairs, exact_joint(model))
    assert stat > 3 * critical
    from test_sampling_loop import PROMPT

    g = torch.Generator().manual_seed(0)
    typical_lp, plain_lp = [0.0, 0], [0.0, 0]
    for _ in range(20):
        out = speculative_generate(runner, Eagle3Drafter(head, 32), PROMPT, 8, set(), k=3, sampling=SAMPLING, generator=g,
                                   verification=rule)
        plain = torch.multinomial(SAMPLING.probs(model(PROMPT).logits[:, -1]), 1, generator=g)  # 1 token: cheap
        for acc, (s, n) in ((typical_lp, text_logprob(model, PROMPT, out.tokens[:1], SAMPLING)),
                            (plain_lp, text_logprob(model, PROMPT, plain[0].tolist(), SAMPLING))):
            acc[0] += s
            acc[1] += n
    assert typical_lp[0] / typical_lp[1] > plain_lp[0] / plain_lp[1]  # the first token is greedy: the likeliest


def test_text_logprob_is_the_sum_of_each_tokens_log_probability_under_the_warped_target(world):
    model, _, _ = world
    from test_sampling_loop import PROMPT

    tokens = [3, 1, 4]
    total, n = text_logprob(model, PROMPT, tokens, SAMPLING)
    want, ids = 0.0, PROMPT
    with torch.no_grad():
        for t in tokens:
            want += float(SAMPLING.probs(model(ids).logits[:, -1])[0, t].clamp(min=1e-30).log())
            ids = torch.cat([ids, torch.tensor([[t]])], dim=1)
    assert n == 3 and total == pytest.approx(want, rel=1e-4, abs=1e-4)


def test_its_flags_are_refused_by_name_where_they_do_not_apply(capsys):
    from headstart.decode.report import run_mode
    from headstart.scripts.benchmark import build_parser, check_args

    base = ["--target", "t", "--questions", "q", "--out", "o", "--method", "medusa", "--draft", "d"]
    p = build_parser()
    for extra, says in ((["--verification", "typical"], "needs --temperature > 0"),
                        (["--temperature", "0.7", "--typical-alpha", "0.2"], "use them with --verification typical"),
                        (["--temperature", "0.7", "--verification", "block", "--tree"], "a tree is verified node by node")):
        with pytest.raises(SystemExit):
            check_args(p, p.parse_args(base + extra))
        assert says in capsys.readouterr().err
    args = p.parse_args(base + ["--temperature", "0.7", "--verification", "typical", "--tree", "--typical-threshold", "0.05"])
    check_args(p, args)
    assert run_mode(args, "float32", "float32") == ("sampling T=0.7 top-p 1.0 top-k 0, typical acceptance (threshold 0.05, "
                                                     "alpha 0.3; not lossless)")
    with pytest.raises(ValueError, match="threshold <= 1"):
        Verification("typical", threshold=1.5)
