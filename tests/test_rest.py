"""REST (decode/rest.py): the suffix array and its lookups against brute force, the drafter greedy-exact through the
loop in chains and trees, the datastore built by `headstart datastore` and refused by name where it cannot serve."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from headstart.decode.generate import plain_generate, speculative_generate
from headstart.decode.rest import Datastore, RestDrafter
from headstart.decode.tree import DynamicTree

REPO = Path(__file__).resolve().parents[1]


def brute_order(tokens: list[int]) -> list[int]:
    return sorted(range(len(tokens)), key=lambda i: [t + 2 for t in tokens[i:]])  # a suffix that ends sorts first


@pytest.mark.parametrize("seed", range(3))
def test_the_suffix_array_and_its_lookups_agree_with_brute_force(seed):
    rng = random.Random(seed)
    for _ in range(60):
        sequences = [[rng.randrange(4) for _ in range(rng.randrange(0, 14))] for _ in range(rng.randrange(1, 5))]
        store = Datastore.build(sequences)
        tokens = store.tokens.tolist()
        assert store.order.tolist() == brute_order(tokens)
        for length in (1, 2, 3):
            pattern = [rng.randrange(4) for _ in range(length)]
            lo, hi = store.find(pattern)
            assert sorted(store.order[lo:hi].tolist()) == [i for i in range(len(tokens)) if tokens[i : i + length] == pattern]
            after = [tokens[i + length] for i in store.order[lo:hi].tolist() if i + length < len(tokens)]
            after = [t for t in after if t >= 0]  # a sequence's end (its separator) is no follower
            want = sorted({t: after.count(t) for t in after}.items(), key=lambda tc: (-tc[1], tc[0]))
            assert store.followers(lo, hi, length, 4) == [(t, c / len(after)) for t, c in want]


def test_a_match_never_crosses_two_sequences():
    store = Datastore.build([[1, 2], [3, 4]])
    lo, hi = store.find([2, 3])
    assert lo == hi  # 2 ends one conversation, 3 starts the next
    assert store.followers(*store.find([1, 2]), 2, 4) == []  # nothing follows a conversation's last token


def test_a_tree_node_narrows_its_parents_matches_and_the_longest_suffix_wins():
    store = Datastore.build([[5, 1, 2, 3], [9, 1, 2, 4], [7, 7, 2, 6]])
    drafter = RestDrafter(store, max_match=16)
    drafter.begin(torch.tensor([[0, 9, 1]]), None, 2)  # context ... 9 1 2: only the second conversation goes on
    assert drafter.children((), 4) == [(4, 1.0)]
    drafter.begin(torch.tensor([[0, 8, 1]]), None, 2)  # ... 8 1 2: "1 2" twice, then 3 or 4
    assert drafter.children((), 4) == [(3, 0.5), (4, 0.5)]
    assert drafter.children((3,), 4) == []  # 1 2 3 ends its conversation
    drafter.begin(torch.tensor([[0, 8, 8]]), None, 2)  # ... 8 2: only "2" matches, three followers
    assert sorted(drafter.children((), 4)) == [(3, 1 / 3), (4, 1 / 3), (6, 1 / 3)]


@pytest.fixture(scope="module")
def tiny():
    from tiny_models import tiny_causal_lm
    from headstart.decode.target_runner import TargetRunner
    from headstart.models.target import Target

    model = tiny_causal_lm("llama", num_hidden_layers=8, vocab_size=32)
    return model, TargetRunner(Target(model), max_len=96)


@pytest.mark.parametrize("tree", [None, DynamicTree(depth=4, topk=3, total_tokens=10)])
def test_rest_decodes_greedy_exact_and_drafts_what_the_datastore_holds(tiny, tree):
    """A datastore of the target's own greedy replies: REST drafts them back (tau well above 1) and the output is the
    target's greedy decoding token for token."""
    model, runner = tiny
    prompts = [torch.tensor([[1, 5, 9, 14, 3, 7]]), torch.tensor([[2, 8, 4, 4]])]
    replies = [prompt[0].tolist() + plain_generate(runner, prompt, 40, set()).tokens for prompt in prompts]
    store = Datastore.build(replies)
    for prompt in prompts:
        plain = plain_generate(runner, prompt, 40, set()).tokens
        spec = speculative_generate(runner, RestDrafter(store), prompt, 40, set(), k=4, tree=tree)
        assert spec.tokens == plain
        assert spec.tau > 2.0
    empty_hit = speculative_generate(runner, RestDrafter(Datastore.build([[31, 31]])), prompts[0], 12, set(), k=4)
    assert empty_hit.tokens == plain_generate(runner, prompts[0], 12, set()).tokens  # nothing found: plain rounds


def test_a_datastore_is_refused_by_name_where_it_cannot_serve(tmp_path):
    Datastore.build([[1, 2, 3]], {"vocab_fingerprint": "x"}).save(tmp_path / "ok")
    assert Datastore.load(tmp_path / "ok").meta["tokens"] == 3
    (tmp_path / "ok" / "suffix_array.npy").unlink()
    with pytest.raises(FileNotFoundError, match="not a REST datastore .missing suffix_array.npy.*headstart datastore"):
        Datastore.load(tmp_path / "ok")
    Datastore.build([]).save(tmp_path / "empty")
    with pytest.raises(ValueError, match="the datastore is empty"):
        Datastore.load(tmp_path / "empty")
    store = Datastore.build([[1, 2, 3]])
    store.save(tmp_path / "odd")
    np.save(tmp_path / "odd" / "suffix_array.npy", np.arange(2))
    with pytest.raises(ValueError, match="do not match; rebuild it"):
        Datastore.load(tmp_path / "odd")


@pytest.mark.slow  # two commands on the demo target: about 30 s
def test_headstart_datastore_builds_from_a_recipe_and_bench_decodes_with_it(tmp_path):
    from headstart.decode.methods import MethodError, load_datastore
    from headstart.models.target import load_tokenizer

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "store"
    files = "--data.files=['configs/demo/data/gsm8k_train.jsonl[:40]']"
    built = subprocess.run([sys.executable, "-m", "headstart.scripts.cli", "datastore", "--config",
                            "configs/demo/eagle3.yaml", "--output", str(out), files],
                           cwd=REPO, capture_output=True, text=True, env=env)
    assert built.returncode == 0, built.stderr
    meta = json.loads((out / "datastore.json").read_text())
    assert meta["sequences"] == 40 and meta["tokens"] > 40 * 20 and meta["build_seconds"] >= 0 and "built in" in built.stdout
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "math", "turns": ["What is 12 + 30?"]}) + "\n")
    bench = subprocess.run([sys.executable, "-m", "headstart.scripts.cli", "bench", "--target", "configs/demo/target",
                            "--questions", str(questions), "--method", "rest", "--datastore", str(out), "--max-new-tokens",
                            "24", "--verify-greedy", "--no-hf-reference", "--out", str(tmp_path / "bench")],
                           cwd=REPO, capture_output=True, text=True, env=env)
    assert bench.returncode == 0, bench.stderr
    assert json.loads((tmp_path / "bench" / "results.json").read_text())["results"]["overall"]["tau"] >= 1.0
    again = subprocess.run([sys.executable, "-m", "headstart.scripts.cli", "datastore", "--config",
                            "configs/demo/eagle3.yaml", "--output", str(out), files], cwd=REPO, capture_output=True,
                           text=True, env=env)
    assert again.returncode == 2 and "--output" in again.stderr  # finished work is never overwritten unasked
    other = load_tokenizer("configs/demo/target")
    other.add_tokens(["<an-added-token>"])
    with pytest.raises(MethodError, match="another tokenizer"):
        load_datastore(str(out), other)
