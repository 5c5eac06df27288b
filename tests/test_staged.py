"""Staged speculative decoding (decode/staged.py): the draft model's own chain, drafted by n-gram lookup -- the same
drafts (greedy and, draw for draw, sampled) as the draft model alone in fewer of its forwards, greedy-exact through the
loop, lossless under sampling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from headstart.decode.draft_model import DraftModelDrafter
from headstart.decode.generate import plain_generate, speculative_generate
from headstart.decode.ngram import prompt_lookup
from headstart.decode.staged import StageCounts, StagedDrafter, staged_tree
from headstart.decode.verify import Sampling

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [torch.tensor([[1, 5, 9, 14, 3, 7]]), torch.tensor([[2, 8, 4, 4]])]


@pytest.fixture(scope="module")
def world():
    from tiny_models import tiny_causal_lm
    from headstart.decode.target_runner import TargetRunner
    from headstart.models.target import Target

    torch.manual_seed(0)
    target = tiny_causal_lm("llama", num_hidden_layers=8, vocab_size=32)
    torch.manual_seed(1)
    small = tiny_causal_lm("llama", num_hidden_layers=1, vocab_size=32)
    return target, small, TargetRunner(Target(target), max_len=128)


def begun(drafter, runner, prompt):
    runner.reset()
    logits, states = runner.forward(prompt)
    runner.commit(prompt.shape[1])
    drafter.begin(prompt, states, int(logits[0, -1].argmax()))
    return drafter


@pytest.mark.parametrize("same", [True, False])
def test_staged_drafts_are_the_draft_model_s_own_in_fewer_forwards(world, same):
    """Draft model = the target (its text loops, so the guesses hold) or another small model: the same drafts and the
    same accepted counts round for round as the draft model alone, greedy-exact; with the target as draft model under
    0.6 of a chain's forwards a draft."""
    target, small, runner = world
    model = target if same else small
    k, counts = 6, StageCounts()
    for prompt in PROMPTS:
        plain = plain_generate(runner, prompt, 48, set()).tokens
        alone = speculative_generate(runner, DraftModelDrafter(model, 128, 32), prompt, 48, set(), k=k)
        staged = speculative_generate(runner, StagedDrafter(model, 128, 32, counts=counts), prompt, 48, set(), k=k)
        assert staged.tokens == alone.tokens == plain
        assert staged.accepted == alone.accepted and staged.proposed == alone.proposed
    if same:  # a chain runs k - 1 forwards for k drafts
        assert counts.forwards / counts.drafts < 0.6 * (k - 1) / k


def test_sampled_drafts_and_q_are_the_draft_model_s_draw_for_draw(world):
    target, _, runner = world
    sampling = Sampling(0.9)
    for prompt in PROMPTS:
        chain = begun(DraftModelDrafter(target, 128, 32), runner, prompt)
        want, want_q = chain.propose_sampled(6, sampling, torch.Generator().manual_seed(3))
        staged = begun(StagedDrafter(target, 128, 32), runner, prompt)
        got, got_q = staged.propose_sampled(6, sampling, torch.Generator().manual_seed(3))
        assert got.tolist() == want.tolist()
        torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-4)


def prefixes(*chains: list[int]) -> set[tuple[int, ...]]:
    return {tuple(c[:i]) for c in chains for i in range(1, len(c) + 1)}


def paths(tree) -> set[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []
    for token, parent in zip(tree.tokens.tolist(), tree.parents.tolist()):
        out.append((out[parent] if parent >= 0 else ()) + (token,))
    return set(out)


def test_the_tree_of_stages_holds_both_chains_and_the_draft_model_keeps_its_cache_right(world):
    """Each round's tree is the draft model's chain and n-gram lookup's, merged; after rounds whose accepted path was
    either, the draft model's next chain is the one a fresh draft model gives over the same tokens (its cache holds
    the emitted tokens, not a rejected chain's); greedy-exact."""
    target, small, runner = world

    class Checked(StagedDrafter):
        def grow_tree(self, spec, max_depth):
            tree = super().grow_tree(spec, max_depth)
            k = min(spec.depth, max_depth)
            fresh = DraftModelDrafter(small, 128, 32)
            fresh.begin(torch.tensor([self.context[:-1]]), None, self.context[-1])
            assert self.drafts == fresh.propose(k).tolist()
            assert paths(tree) == prefixes(self.drafts, prompt_lookup(self.context, k, self.max_ngram))
            self.rounds += 1
            return tree

    for prompt in PROMPTS:
        drafter = Checked(small, 128, 32)
        drafter.rounds = 0
        got = speculative_generate(runner, drafter, prompt, 40, set(), k=5, tree=staged_tree(5))
        assert got.tokens == plain_generate(runner, prompt, 40, set()).tokens
        assert drafter.rounds == len(got.accepted) > 1


@pytest.mark.slow  # 2,500 sampled requests a shape: about 40 s each
@pytest.mark.parametrize("tree", [None, staged_tree(3)])
def test_staged_samples_follow_the_target(tree):
    from test_sampling_loop import chi2_vs, exact_joint, sample_pairs
    from tiny_models import tiny_causal_lm
    from headstart.decode.target_runner import TargetRunner
    from headstart.models.target import Target

    model = tiny_causal_lm("llama", num_hidden_layers=8, vocab_size=8)
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)  # the world of tests/test_sampling_loop.py
    torch.manual_seed(5)
    small = tiny_causal_lm("llama", num_hidden_layers=1, vocab_size=8)
    pairs = sample_pairs(TargetRunner(Target(model), max_len=32), lambda: StagedDrafter(small, 32, 8, max_ngram=2), 2500,
                         seed=0, tree=tree)
    stat, critical = chi2_vs(pairs, exact_joint(model))
    assert stat < critical


@pytest.mark.parametrize(("flags", "refusal"), [
    (["--method", "ngram", "--staged-tree"], "--staged-tree is another method's flag"),
    (["--method", "staged", "--draft", "d", "--staged-tree", "--predict"], "--staged-tree verifies a tree"),
    (["--method", "staged", "--draft", "d", "--tree"], "--tree: --method staged cannot draft a dynamic tree"),
])
def test_bad_staged_flags_are_refused_by_name_before_loading(flags, refusal, capsys):
    from headstart.scripts import benchmark

    with pytest.raises(SystemExit) as stop:
        benchmark.main(["--target", "/nonexistent", "--questions", "/nonexistent.jsonl", "--out", "/nonexistent-out",
                        *flags])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and refusal in err and "Traceback" not in err


@pytest.mark.slow  # the demo target and its draft model twice: about 40 s
def test_bench_runs_staged_paired_with_its_draft_model_alone(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": "math", "turns": [q]}) + "\n"
                                 for i, q in enumerate(["What is 12 + 30?", "Count from one to ten."])))
    draft = "configs/demo/draft-model"
    bench = subprocess.run([sys.executable, "-m", "headstart.scripts.cli", "bench", "--target", "configs/demo/target",
                            "--questions", str(questions), "--method", "staged", "--draft", draft,
                            "--num-speculative-tokens", "5", "--max-new-tokens", "32", "--verify-greedy",
                            "--no-hf-reference", "--versus", f"--method draft-model --draft {draft} "
                            "--num-speculative-tokens 5", "--out", str(tmp_path / "bench")],
                           cwd=REPO, capture_output=True, text=True, env=env)
    assert bench.returncode == 0, bench.stderr
    results = json.loads((tmp_path / "bench" / "results.json").read_text())
    versus = json.loads((tmp_path / "bench" / "versus" / "results.json").read_text())
    assert results["results"]["overall"]["tau"] == versus["results"]["overall"]["tau"]  # the same drafts
    assert "forwards a draft" in results["mode"]
