"""Lookahead decoding (decode/lookahead.py): the window's tree and its n-grams on a hand example, the round's size
within what its settings promise, greedy-exact through the loop in every shape (filling, full, cut by the length
budget), lossless under sampling, and its flags refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from headstart.decode.generate import plain_generate, speculative_generate
from headstart.decode.lookahead import LookaheadDrafter, LookaheadParams

REPO = Path(__file__).resolve().parents[1]


def paths(tree) -> set[tuple[int, ...]]:
    """Every node of a draft tree as its path of tokens from the root."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    out = []
    for i, t in enumerate(tokens):
        out.append((out[parents[i]] if parents[i] >= 0 else ()) + (t,))
    return set(out)


def test_the_window_is_a_tree_of_columns_and_each_column_becomes_an_n_gram():
    """W = 3, N = 4 with levels set by hand: level 0 (2 guesses) a chain below the root, column c's levels 1..2 below
    level 0's c-th token; the target's tokens at the column tops make three 4-grams and the next window."""
    drafter = LookaheadDrafter(LookaheadParams(window=3, ngram=4, guesses=2))
    drafter.begin(torch.tensor([[1, 2, 3]]), None, 9)
    assert len(drafter.levels) == 1 and len(drafter.levels[0]) == 3 + 4 - 3  # level 0 only, one guess per level to fill
    drafter.levels = [[10, 11], [20, 21, 22], [30, 31, 32]]  # full: N - 1 = 3 levels
    tree = drafter.grow_tree(LookaheadParams().tree(), max_depth=16)
    assert paths(tree) == {(10,), (10, 11),  # level 0
                           (20,), (20, 30),  # column 0, below the root
                           (10, 21), (10, 21, 31),  # column 1, below 10
                           (10, 11, 22), (10, 11, 22, 32)}  # column 2, below 11
    depth = dict(zip(tree.tokens.tolist(), tree.depths.tolist()))
    assert depth[32] == 4 and depth[22] == 3 and depth[30] == 2  # each guess at its column + level's position
    choices = torch.zeros(1 + tree.size, dtype=torch.long)
    for i, token in enumerate(tree.tokens.tolist()):  # the target's token at each top: 40 + column
        choices[1 + i] = {30: 40, 31: 41, 32: 42}.get(token, 0)
    drafter.observed(choices)
    assert {key: list(kept) for key, kept in drafter.pool.items()} == {
        9: [(20, 30, 40)], 10: [(21, 31, 41)], 11: [(22, 32, 42)]}  # root/level-0 token, then the column upwards
    assert drafter.levels == [[21, 22], [30, 31, 32], [40, 41, 42]]  # every level a position on, the new one on top
    drafter.update([5, 9], None)  # the root is 9 again: its n-gram is a guess of the next round
    assert (20, 30, 40) in paths(drafter.grow_tree(LookaheadParams().tree(), 16))


def test_the_pool_keeps_the_newest_g_n_grams_per_first_token():
    drafter = LookaheadDrafter(LookaheadParams(ngram=3, guesses=2))
    drafter.begin(torch.tensor([[1, 2]]), None, 3)
    for ngram in ([7, 1, 1], [7, 2, 2], [7, 1, 1], [7, 3, 3]):
        drafter._remember(ngram)
    assert list(drafter.pool[7]) == [(1, 1), (3, 3)]  # (1, 1) seen again became the newest; (2, 2) left first
    none = LookaheadDrafter(LookaheadParams(ngram=3, guesses=0))
    none.begin(torch.tensor([[1, 2]]), None, 3)
    none._remember([7, 1, 1])
    assert none.pool == {}


def test_from_context_holds_the_requests_own_n_grams():
    drafter = LookaheadDrafter(LookaheadParams(ngram=3, guesses=4, from_context=True))
    drafter.begin(torch.tensor([[5, 6, 7, 5]]), None, 6)
    assert {k: list(v) for k, v in drafter.pool.items()} == {5: [(6, 7)], 6: [(7, 5)], 7: [(5, 6)]}
    drafter.update([8], None)  # 5, 6, 8 is an n-gram now
    assert list(drafter.pool[5]) == [(6, 7), (6, 8)]


@pytest.fixture(scope="module")
def tiny():
    from tiny_models import tiny_causal_lm
    from headstart.decode.target_runner import TargetRunner
    from headstart.models.target import Target

    model = tiny_causal_lm("llama", num_hidden_layers=8, vocab_size=32)
    return model, TargetRunner(Target(model), max_len=160)


PROMPTS = [torch.tensor([[1, 5, 9, 14, 3, 7]]), torch.tensor([[2, 8, 4, 4]])]


class Recorded(LookaheadDrafter):
    """Each round's tree size and depth, to hold them to what the settings promise."""

    def __init__(self, params: LookaheadParams) -> None:
        super().__init__(params)
        self.rounds: list[tuple[int, int]] = []

    def grow_tree(self, spec, max_depth):
        tree = super().grow_tree(spec, max_depth)
        self.rounds.append((tree.size, tree.max_depth))
        return tree


@pytest.mark.parametrize("params", [LookaheadParams(), LookaheadParams(window=1, ngram=2, guesses=2),
                                    LookaheadParams(window=4, ngram=3, guesses=3, from_context=True),
                                    LookaheadParams(window=2, ngram=6, guesses=1)])
def test_lookahead_is_greedy_exact_and_its_rounds_stay_within_their_settings(tiny, params):
    _, runner = tiny
    for prompt in PROMPTS:
        for n in (3, 48):  # 3: the length budget leaves the window out of the last rounds
            plain = plain_generate(runner, prompt, n, set()).tokens
            drafter = Recorded(params)
            spec = speculative_generate(runner, drafter, prompt, n, set(), k=4, tree=params.tree())
            assert spec.tokens == plain, params
            assert max(size for size, _ in drafter.rounds) <= params.nodes
            assert max(depth for _, depth in drafter.rounds) <= params.depth
    assert max(size for size, _ in drafter.rounds) > 0


def test_the_window_s_n_grams_are_accepted(tiny):
    """A random tiny model's greedy text falls into loops, which Jacobi iterations find: the window's own guesses are
    accepted (no n-gram verified), and the n-grams it made, verified, add to them on every prompt."""
    _, runner = tiny
    taus = {}
    for guesses in (0, 7):
        params = LookaheadParams(guesses=guesses)
        taus[guesses] = [speculative_generate(runner, LookaheadDrafter(params), p, 64, set(), k=4, tree=params.tree()).tau
                         for p in PROMPTS]
    assert min(taus[0]) > 1.5 and all(with_pool > alone for with_pool, alone in zip(taus[7], taus[0]))


@pytest.mark.slow  # 2,500 sampled requests: about 40 s
def test_lookahead_samples_follow_the_target():
    """Lossless sampling by the shipped chi-square test: the window guesses from samples, its n-grams verified by one
    sample of the warped target per node."""
    from test_sampling_loop import chi2_vs, exact_joint, sample_pairs
    from tiny_models import tiny_causal_lm
    from headstart.decode.target_runner import TargetRunner
    from headstart.models.target import Target

    model = tiny_causal_lm("llama", num_hidden_layers=8, vocab_size=8)
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)  # the world of tests/test_sampling_loop.py
    params = LookaheadParams(window=3, ngram=3, guesses=3, from_context=True)
    pairs = sample_pairs(TargetRunner(Target(model), max_len=32), lambda: LookaheadDrafter(params), 2500, seed=0,
                         tree=params.tree())
    stat, critical = chi2_vs(pairs, exact_joint(model))
    assert stat < critical


BASE = ["--target", "/nonexistent", "--questions", "/nonexistent.jsonl", "--out", "/nonexistent-out"]


@pytest.mark.parametrize(("flags", "refusal"), [
    (["--method", "ngram", "--lookahead-window", "3"], "--lookahead-window is another method's flag"),
    (["--method", "lookahead", "--lookahead-ngram", "1"], "--lookahead-ngram 1"),
    (["--method", "lookahead", "--lookahead-window", "0"], "--lookahead-window 0"),
    (["--method", "lookahead", "--lookahead-guesses", "-1"], "--lookahead-guesses -1"),
    (["--method", "lookahead", "--lookahead-window", "1", "--lookahead-ngram", "2", "--lookahead-guesses", "0"],
     "drafts nothing"),
    (["--method", "lookahead", "--max-len", "40"], "does not fit --max-len 40"),
    (["--method", "lookahead", "--tree"], "--tree: --method lookahead cannot draft a dynamic tree (its drafter drafts its own trees)"),
    (["--method", "lookahead", "--predict"], "--predict: --method lookahead drafts a tree of its own"),
    (["--method", "lookahead", "--temperature", "0.7", "--verification", "block"], "--verification block: --method lookahead"),
])
def test_bad_lookahead_flags_are_refused_by_name_before_loading(flags, refusal, capsys):
    from headstart.scripts import benchmark

    with pytest.raises(SystemExit) as stop:
        benchmark.main([*BASE, *flags])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and refusal in err and "Traceback" not in err


@pytest.mark.slow  # the demo target twice: about 30 s
def test_bench_runs_lookahead_paired_with_ngram_lookup(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": "math", "turns": [q]}) + "\n"
                                 for i, q in enumerate(["What is 12 + 30?", "Count from one to ten."])))
    bench = subprocess.run([sys.executable, "-m", "headstart.scripts.cli", "bench", "--target", "configs/demo/target",
                            "--questions", str(questions), "--method", "lookahead", "--max-new-tokens", "32",
                            "--verify-greedy", "--no-hf-reference", "--versus", "--method ngram", "--out",
                            str(tmp_path / "bench")], cwd=REPO, capture_output=True, text=True, env=env)
    assert bench.returncode == 0, bench.stderr
    results = json.loads((tmp_path / "bench" / "results.json").read_text())
    assert results["results"]["overall"]["tau"] >= 1.0 and "paired" in results
    assert results["shape"] == "lookahead window 7 n-grams of 5 7 guesses"
    assert len(results["results"]["overall"]["acceptance_by_position"]) == LookaheadParams().depth  # up to its depth
