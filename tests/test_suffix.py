"""Suffix decoding (decode/suffix_tree.py, decode/suffix.py): the trees' counts against brute force as sequences grow
and are evicted, the speculation rule (adaptive length, probability cut, best score over match lengths), the drafter
greedy-exact through the loop in chains and trees, learning across requests, lossless under sampling, and its flags
refused by name."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from headstart.decode.generate import plain_generate, speculative_generate
from headstart.decode.rest import Datastore
from headstart.decode.suffix import SuffixCache, SuffixDrafter, SuffixParams
from headstart.decode.suffix_tree import SuffixTree, speculate
from headstart.decode.tree import DynamicTree

REPO = Path(__file__).resolve().parents[1]


def occurrences(sequences: list[list[int]], pattern: list[int]) -> int:
    return sum(seq[i: i + len(pattern)] == pattern for seq in sequences for i in range(len(seq) - len(pattern) + 1))


def check_counts(tree: SuffixTree, sequences: list[list[int]], rng: random.Random) -> None:
    """Every pattern up to the tree's depth: located exactly where it occurs, counted as often, its followers too."""
    for _ in range(150):
        pattern = [rng.randrange(3) for _ in range(rng.randrange(1, tree.depth + 1))]
        node, n = tree.locate(pattern), occurrences(sequences, pattern)
        assert (node is None) == (n == 0), pattern
        if node is None:
            continue
        assert tree.total(node) == n
        if len(pattern) < tree.depth:
            want = sorted(((t, occurrences(sequences, pattern + [t])) for t in range(3)), key=lambda tc: (-tc[1], tc[0]))
            assert [(t, c) for t, c, _ in tree.branches(node, 3)] == [(t, c) for t, c in want if c]
            assert [(t, c) for t, c, _ in tree.branches(node, 1)] == [(t, c) for t, c in want if c][:1]
    assert tree.tokens == sum(map(len, sequences))


@pytest.mark.parametrize("seed", range(3))
def test_the_tree_counts_every_run_as_sequences_grow_and_are_removed(seed):
    rng = random.Random(seed)
    tree, held = SuffixTree(depth=4), {}
    for step in range(40):
        seq = rng.randrange(5)
        if seq in held and rng.random() < 0.2:
            tree.remove(seq)
            del held[seq]
        else:
            more = [rng.randrange(3) for _ in range(rng.randrange(1, 7))]
            tree.extend(seq, more)  # a token at a time inside: the open suffixes grow
            held.setdefault(seq, []).extend(more)
        if step % 5 == 4:
            check_counts(tree, list(held.values()), rng)
    for seq in list(held):
        tree.remove(seq)
    assert tree.tokens == 0 and tree.children[0] == {}  # nothing left of any sequence


def test_a_speculation_is_as_long_as_its_match_earns_and_as_likely_as_min_prob_allows():
    tree = SuffixTree(depth=8)
    tree.extend("a", [1, 2, 3, 4, 5, 6])
    tree.extend("b", [9, 2, 3, 4, 7, 7])
    # "2 3 4" matched (3 tokens): 5 or 7 next, half each; one draft a matched token.
    found = speculate(tree, [8, 2, 3, 4], budget=8, min_prob=0.1)
    assert found.match == 3 and found.tokens == [5, 6] and found.probs == [0.5, 0.5]  # 5 before 7: the smaller id
    assert speculate(tree, [8, 2, 3, 4], budget=1).tokens == [5]  # k caps it
    assert speculate(tree, [8, 2, 3, 4], budget=8, spec_factor=0.5).tokens == [5]  # 3 * 0.5 -> 1 draft
    assert speculate(tree, [8, 2, 3, 4], budget=8, min_prob=0.6).tokens == []  # nothing that likely
    # "1 2 3 4": the longer match knows the continuation for sure and outscores the shorter ones.
    longer = speculate(tree, [1, 2, 3, 4], budget=8, min_prob=0.1)
    assert longer.match == 4 and longer.tokens == [5, 6] and longer.probs == [1.0, 1.0]
    # A tree: both continuations, best first, parents before children.
    grown = speculate(tree, [8, 2, 3, 4], budget=8, topk=2, min_prob=0.1)
    assert grown.tokens == [5, 7, 6] and grown.parents == [-1, -1, 0] and grown.depths == [1, 1, 2]  # 3 matched: 3 nodes
    grown = speculate(tree, [8, 2, 3, 4], budget=8, topk=2, spec_offset=1)
    assert grown.tokens == [5, 7, 6, 7] and grown.parents == [-1, -1, 0, 1]
    assert speculate(tree, [8, 2, 3, 4], budget=4, topk=2, levels=1).tokens == [5, 7]
    short = speculate(tree, [4, 4], budget=4)  # "4 4" never occurred; "4" did: one draft, of p 0.5
    assert short.match == 1 and short.tokens == [5]
    assert speculate(tree, [6, 0], budget=4).tokens == []  # "0" never occurred: nothing to draft


@pytest.fixture(scope="module")
def tiny():
    from tiny_models import tiny_causal_lm
    from headstart.decode.target_runner import TargetRunner
    from headstart.models.target import Target

    model = tiny_causal_lm("llama", num_hidden_layers=8, vocab_size=32)
    return model, TargetRunner(Target(model), max_len=128)


PROMPTS = [torch.tensor([[1, 5, 9, 14, 3, 7]]), torch.tensor([[2, 8, 4, 4]])]


@pytest.mark.parametrize("tree", [None, DynamicTree(depth=4, topk=3, total_tokens=10)])
def test_suffix_decoding_is_greedy_exact_and_learns_the_replies_it_serves(tiny, tree):
    """The second time a request comes, the global tree holds the target's reply to it: drafts are accepted far more
    (tau), and every output is the target's greedy decoding token for token."""
    _, runner = tiny
    cache = SuffixCache(SuffixParams(max_depth=16))
    first, again = [], []
    for prompt in PROMPTS + PROMPTS:
        plain = plain_generate(runner, prompt, 40, set()).tokens
        spec = speculative_generate(runner, SuffixDrafter(cache), prompt, 40, set(), k=6, tree=tree)
        assert spec.tokens == plain
        (again if len(first) == len(PROMPTS) else first).append(spec.tau)
    assert cache.tree.sequences == 4 and cache.tree.tokens == 4 * 40  # every reply whole, the last round's too
    assert min(again) > 3.0 and min(again) > max(first)
    cache.forget()
    assert cache.tree.sequences == 0 and cache.tree.tokens == 0


def test_the_global_tree_keeps_the_newest_replies_and_none_at_max_cached_0(tiny):
    _, runner = tiny
    cache = SuffixCache(SuffixParams(max_depth=8, max_cached=1))
    replies = [speculative_generate(runner, SuffixDrafter(cache), p, 12, set(), k=4).tokens for p in PROMPTS]
    assert cache.tree.sequences == 1 and cache.tree.tokens == 12
    assert cache.tree.locate(replies[1][:7]) is not None  # the newest reply is held ...
    assert cache.tree.total(cache.tree.locate(replies[1][:1])) == replies[1].count(replies[1][0])  # ... alone
    drafter = SuffixDrafter(cache)
    speculative_generate(runner, drafter, PROMPTS[0], 3, set(), k=4)
    speculative_generate(runner, drafter, PROMPTS[0], 12, set(), k=4)  # the same request restarted: one reply held
    assert cache.tree.sequences == 1 and cache.tree.tokens == 12 and cache.tree.locate(replies[1][:1]) is None
    none = SuffixCache(SuffixParams(max_depth=8, max_cached=0))
    out = speculative_generate(runner, SuffixDrafter(none), PROMPTS[0], 12, set(), k=4)
    assert out.tokens == plain_generate(runner, PROMPTS[0], 12, set()).tokens and none.tree.tokens == 0


def test_a_datastore_is_read_where_neither_tree_has_the_reply(tiny):
    """A fresh cache with a REST datastore of the target's replies (earlier traffic): drafted back from the first
    request."""
    _, runner = tiny
    replies = [p[0].tolist() + plain_generate(runner, p, 40, set()).tokens for p in PROMPTS]
    bare = SuffixCache(SuffixParams(max_depth=16))
    warm = SuffixCache(SuffixParams(max_depth=16), Datastore.build(replies))
    for prompt in PROMPTS:
        plain = plain_generate(runner, prompt, 40, set()).tokens
        cold = speculative_generate(runner, SuffixDrafter(bare), prompt, 40, set(), k=6)
        hot = speculative_generate(runner, SuffixDrafter(warm), prompt, 40, set(), k=6)
        assert hot.tokens == plain and hot.tau > 3.0 and hot.tau > cold.tau


@pytest.mark.parametrize(("field", "value", "flag"), [("max_depth", 1, "--suffix-max-depth"),
                                                       ("spec_factor", -1.0, "--suffix-spec-factor"),
                                                       ("min_prob", 1.5, "--suffix-min-prob"),
                                                       ("max_cached", -1, "--suffix-max-cached")])
def test_bad_settings_are_refused_by_flag(field, value, flag):
    with pytest.raises(ValueError, match=flag):
        SuffixParams(**{field: value})
    with pytest.raises(ValueError, match="not both 0"):
        SuffixParams(spec_factor=0.0, spec_offset=0.0)


def test_suffix_flags_are_refused_for_another_method_and_bad_ones_before_loading(capsys):
    from headstart.scripts import benchmark

    base = ["--target", "/nonexistent", "--questions", "/nonexistent.jsonl", "--out", "/nonexistent-out"]
    with pytest.raises(SystemExit) as stop:
        benchmark.main([*base, "--method", "ngram", "--suffix-min-prob", "0.3"])
    assert stop.value.code == 2 and "--suffix-min-prob is another method's flag" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        benchmark.main([*base, "--method", "suffix", "--suffix-max-depth", "1"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "--suffix-max-depth 1" in err and "Traceback" not in err


@pytest.mark.slow  # 2,500 sampled requests a shape: about 40 s each
@pytest.mark.parametrize("tree", [None, DynamicTree(depth=3, topk=3, total_tokens=8)])
def test_suffix_samples_follow_the_target(tree):
    """Lossless sampling by the shipped chi-square test, with a global tree that learns every sampled reply (so each
    request drafts from the ones before it)."""
    from test_sampling_loop import chi2_vs, exact_joint, sample_pairs
    from tiny_models import tiny_causal_lm
    from headstart.decode.target_runner import TargetRunner
    from headstart.models.target import Target

    model = tiny_causal_lm("llama", num_hidden_layers=8, vocab_size=8)
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)  # the world of tests/test_sampling_loop.py
    cache = SuffixCache(SuffixParams(max_depth=8, max_cached=200))
    pairs = sample_pairs(TargetRunner(Target(model), max_len=32), lambda: SuffixDrafter(cache), 2500, seed=0, tree=tree)
    stat, critical = chi2_vs(pairs, exact_joint(model))
    assert stat < critical
    assert cache.tree.sequences == 200


@pytest.mark.slow  # the demo target twice: about 30 s
def test_bench_runs_suffix_paired_with_ngram_lookup(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": "math", "turns": [q]}) + "\n"
                                 for i, q in enumerate(["What is 12 + 30?", "What is 12 + 31?"])))
    bench = subprocess.run([sys.executable, "-m", "headstart.scripts.cli", "bench", "--target", "configs/demo/target",
                            "--questions", str(questions), "--method", "suffix", "--num-speculative-tokens", "6", "--max-new-tokens", "32",
                            "--verify-greedy", "--no-hf-reference", "--versus", "--method ngram", "--out",
                            str(tmp_path / "bench")], cwd=REPO, capture_output=True, text=True, env=env)
    assert bench.returncode == 0, bench.stderr
    results = json.loads((tmp_path / "bench" / "results.json").read_text())
    assert results["results"]["overall"]["tau"] >= 1.0 and "paired" in results
    assert "suffix trees depth 24" in results["mode"] and "global tree of 2 replies" in results["mode"]
