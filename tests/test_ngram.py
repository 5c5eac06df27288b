"""n-gram lookup: its counts of what followed each suffix, the trees it grows from them, and decoding with them."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_causal_lm

from headstart.decode.generate import greedy_generate, speculative_generate
from headstart.decode.ngram import NgramDrafter
from headstart.decode.ngram_store import NgramStore
from headstart.trainer.ngram_corpus import ngram_store_from_conversations
from headstart.decode.target_runner import TargetRunner
from headstart.decode.tree import DynamicTree
from headstart.models.target import Target, load_tokenizer

REPO = Path(__file__).resolve().parents[1]


def drafter_over(context: list[int], max_ngram: int = 3) -> NgramDrafter:
    drafter = NgramDrafter(max_ngram)
    drafter.begin(torch.tensor([context[:-1]]), None, context[-1])
    return drafter


def test_children_come_from_the_longest_suffix_seen_before_by_count_then_recency():
    drafter = drafter_over([1, 2, 3, 1, 2, 4, 1, 2])
    # (4, 1, 2) never came before; (1, 2) was followed by 3, then by 4 (more recent)
    assert drafter.children((), 4) == [(4, 0.5), (3, 0.5)]
    assert drafter.children((), 1) == [(4, 0.5)]
    assert drafter.children((4,), 4) == [(1, 1.0)]  # (1, 2, 4) -> 1
    assert drafter.children((9,), 4) == []  # nothing ever followed 9
    drafter.update([3, 1, 2], None)
    assert drafter.children((), 4) == [(4, 1.0)]  # (3, 1, 2) came once before, followed by 4: the longest match wins
    assert drafter_over([1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 2], max_ngram=1).children((), 4) == [(3, 2 / 3), (4, 1 / 3)]


def test_the_tree_keeps_the_likeliest_nodes_best_first_within_its_limits():
    drafter = drafter_over([1, 2, 3, 1, 2, 4, 1, 2])
    tree = drafter.grow_tree(DynamicTree(depth=3, topk=2, total_tokens=4), max_depth=10)
    # root children 4 and 3 (p 1/2 each, 4 the more recent), then each one's only child 1 (p 1/2 on its path)
    assert tree.tokens.tolist() == [4, 3, 1, 1]
    assert tree.parents.tolist() == [-1, -1, 0, 1]
    assert tree.depths.tolist() == [1, 1, 2, 2] and tree.max_depth == 2
    whole = drafter.grow_tree(DynamicTree(depth=3, topk=2, total_tokens=40), max_depth=10)
    assert whole.max_depth == 3 and whole.size == 6  # 4 -> 1 -> 2 and 3 -> 1 -> 2: every path ends at depth 3
    assert whole.tokens.tolist()[:4] == [4, 3, 1, 1]
    assert drafter.grow_tree(DynamicTree(depth=3, topk=2, total_tokens=40), max_depth=1).tokens.tolist() == [4, 3]
    assert drafter.grow_tree(DynamicTree(depth=3, topk=1, total_tokens=40), max_depth=10).tokens.tolist() == [4, 1, 2]
    assert drafter_over([5, 6, 7]).grow_tree(DynamicTree(), max_depth=10).size == 0  # no suffix ever repeats


def test_a_grown_tree_is_topological_with_distinct_siblings_and_scores_that_never_rise():
    g = torch.Generator().manual_seed(0)
    drafter = drafter_over(torch.randint(0, 6, (300,), generator=g).tolist())  # a small alphabet: a bushy tree
    tree = drafter.grow_tree(DynamicTree(depth=5, topk=3, total_tokens=30), max_depth=10)
    tokens, parents, depths = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
    assert len(tokens) == 30 and max(depths) <= 5
    paths: list[tuple[int, ...]] = []
    logps = []
    for token, parent, depth in zip(tokens, parents, depths):
        assert parent < len(paths)  # a parent comes before its children
        path = (paths[parent] if parent >= 0 else ()) + (token,)
        assert depth == len(path)
        prob = dict(drafter.children(path[:-1], 3))[token]  # each node is one of its parent's top-3 continuations
        logps.append((logps[parent] if parent >= 0 else 0.0) + torch.tensor(prob).log().item())
        paths.append(path)
    assert len(set(paths)) == len(paths)  # siblings are distinct tokens
    assert all(a >= b - 1e-9 for a, b in zip(logps, logps[1:]))  # added best first


def test_the_store_counts_only_what_follows_into_assistant_tokens():
    store = NgramStore(max_ngram=2, min_ngram=1)
    store.add([1, 2, 3, 1, 2, 4], followers=[0, 0, 0, 1, 1, 1])  # a user turn 1 2 3, then the assistant says 1 2 4
    assert store.tokens == 3
    assert store.lookup((3,), 4) == [(1, 1.0)] and store.lookup((2, 3), 4) == [(1, 1.0)]
    assert store.lookup((1,), 4) == [(2, 1.0)]  # once, at the assistant's 1 -> 2; the user's 1 -> 2 is not counted
    assert store.lookup((2,), 4) == [(4, 1.0)]  # the user's 2 -> 3 is not counted
    assert store.lookup((1, 2), 4) == [(4, 1.0)]
    assert store.lookup((9,), 4) is None and store.lookup((1, 2, 4), 4) is None  # unseen; longer than max_ngram
    assert store.ngrams == 6  # (3,) (2,3) (1,) (3,1) (2,) (1,2)
    store.add([1, 2, 4])
    store.add([1, 2, 5])
    assert store.lookup((1, 2), 4) == [(4, 2 / 3), (5, 1 / 3)] and store.lookup((1, 2), 1) == [(4, 2 / 3)]
    store.add([7, 1, 2, 5, 8, 1, 2, 5])
    assert store.lookup((1, 2), 4) == [(5, 3 / 5), (4, 2 / 5)]  # by count
    assert store.lookup((2,), 4) == [(5, 3 / 5), (4, 2 / 5)]
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        NgramStore(max_ngram=2, min_ngram=3)


def test_the_store_finds_every_ngram_it_counted_and_its_counts():
    """The store's sorted hash tables against plain counting, on random sequences over a small alphabet."""
    g = torch.Generator().manual_seed(0)
    store, want = NgramStore(max_ngram=4, min_ngram=2), {}
    for _ in range(20):
        ids = torch.randint(0, 50, (60,), generator=g).tolist()
        store.add(ids)
        for j in range(1, len(ids)):
            for n in range(2, min(4, j) + 1):
                counts = want.setdefault(tuple(ids[j - n : j]), {})
                counts[ids[j]] = counts.get(ids[j], 0) + 1
    assert store.ngrams == len(want)
    for key, counts in want.items():
        total = sum(counts.values())
        got = store.lookup(key, 100)
        assert dict(got) == pytest.approx({t: c / total for t, c in counts.items()}), key
        assert [p for _, p in got] == sorted((p for _, p in got), reverse=True)


def test_the_store_reads_conversations_rendered_as_the_target_sees_them(tmp_path):
    tokenizer = load_tokenizer(str(REPO / "configs/demo/target"))
    rows = [{"messages": [{"role": "user", "content": "Say it."}, {"role": "assistant", "content": "It is done now."}]},
            {"messages": [{"role": "user", "content": "no reply"}]},  # no assistant turn: skipped
            {"question": "Q?", "answer": "A."}]  # another format in the same file: the first row's is read
    data = tmp_path / "replies.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    store = ngram_store_from_conversations([str(data)], tokenizer, max_ngram=3)
    reply = tokenizer("It is done now.", add_special_tokens=False)["input_ids"]
    assert store.lookup(tuple(reply[:2]), 4) == [(reply[2], 1.0)]
    user = tokenizer("Say it.", add_special_tokens=False)["input_ids"]
    assert all(store.lookup(tuple(user[i : i + 2]), 4) is None for i in range(len(user) - 2))  # user text: context only
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "plain"}) + "\n")
    with pytest.raises(ValueError, match="not 'text' rows"):
        ngram_store_from_conversations([str(text)], tokenizer)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps(rows[1]) + "\n")
    with pytest.raises(ValueError, match="empty.jsonl: no conversation"):
        ngram_store_from_conversations([str(empty)], tokenizer)
    odd = tmp_path / "odd.jsonl"
    odd.write_text(json.dumps({"prompt": "p", "completion": "c"}) + "\n")
    with pytest.raises(ValueError, match="odd.jsonl: cannot detect the row format"):
        ngram_store_from_conversations([str(odd)], tokenizer)


def test_the_request_wins_at_equal_length_and_the_store_fills_in_longer_or_missing_matches():
    store = NgramStore(max_ngram=3, min_ngram=2)
    store.add([7, 8, 9, 7, 8, 10, 5, 6, 11])
    drafter = NgramDrafter(max_ngram=3, store=store)
    drafter.begin(torch.tensor([[7, 8, 12, 5]]), None, 6)  # context 7 8 12 5 6
    assert drafter.children((), 2) == [(11, 1.0)]  # (5, 6) never came before in the request; the store has it
    drafter.update([7, 8], None)  # context ... 6 7 8: (6, 7, 8) nowhere; (7, 8) -> 12 here, -> 9 / 10 in the store
    assert drafter.children((), 2) == [(12, 1.0)]
    assert drafter.children((12,), 2) == [(5, 1.0)]
    store.add([6, 7, 8, 13])
    assert drafter.children((), 2) == [(13, 1.0)]  # the store's longer match (6, 7, 8) wins
    assert drafter.propose(3).tolist() == [13]  # a chain: the tree of one branch (nothing ever followed 13)
    assert NgramDrafter(store=store).children((), 1) == []  # no context at all: nothing to look up


def test_learning_counts_generated_tokens_beside_the_tables_and_forgetting_drops_them():
    g = torch.Generator().manual_seed(1)
    base, reply = torch.randint(0, 5, (200,), generator=g).tolist(), torch.randint(0, 5, (60,), generator=g).tolist()
    learned, counted = NgramStore(max_ngram=3), NgramStore(max_ngram=3)
    learned.add(base)
    counted.add(base)
    before = {key: learned.lookup(key, 5) for key in itertools.product(range(5), repeat=2)}
    context = [4, 4, 3]  # the prompt: its own n-grams are not counted, the windows reaching into the reply are
    learned.learn(context + reply, start=len(context))
    counted.add(context + reply, followers=[0] * len(context) + [1] * len(reply))
    assert learned.learned_tokens == len(reply)
    for n in (2, 3):
        for key in itertools.product(range(5), repeat=n):  # the tables and the learned counts merged = counting it all
            assert learned.lookup(key, 5) == counted.lookup(key, 5), key
    learned.forget()
    assert learned.learned_tokens == 0
    assert {key: learned.lookup(key, 5) for key in before} == before


def test_a_learning_drafter_proposes_an_earlier_reply_to_a_later_request():
    target = Target(tiny_causal_lm("llama", num_hidden_layers=8))
    runner = TargetRunner(target, max_len=160)
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])  # nothing repeats: n-gram lookup alone has nothing to draft
    want = greedy_generate(runner, prompt, 40, set()).tokens
    store = NgramStore()
    first = speculative_generate(runner, NgramDrafter(store=store, learn=True), prompt, 40, set(), k=4)
    # every generated token, the last round's too (the loop's finish), as far as the output keeps it
    assert first.tokens == want and store.learned_tokens == len(want)
    assert store.lookup((5, 6), 4) is None  # the prompt's own n-grams are the user's: not learned
    again = speculative_generate(runner, NgramDrafter(store=store), prompt, 40, set(), k=4)
    assert again.tokens == want and again.accepted[0] == 4 and again.target_forwards <= len(want) // 3
    with pytest.raises(ValueError, match="pass store="):
        NgramDrafter(learn=True)


@pytest.mark.parametrize("with_store", [False, True])
@pytest.mark.parametrize("tree", [None, DynamicTree(depth=4, topk=3, total_tokens=10)])
def test_ngram_decoding_in_chains_and_trees_is_the_targets_greedy_decoding(tree, with_store):
    target = Target(tiny_causal_lm("llama", num_hidden_layers=8))
    runner = TargetRunner(target, max_len=160)
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 9, 8, 5, 6, 7, 10, 5, 6]])
    want = greedy_generate(runner, prompt, 60, set()).tokens
    store = None
    if with_store:
        store = NgramStore()
        store.add(prompt[0].tolist() + want)  # the reply itself in the store: drafts accepted from the first round
    out = speculative_generate(runner, NgramDrafter(store=store), prompt, 60, set(), k=4, tree=tree)
    assert out.tokens == want
    assert sum(out.accepted) > 10  # drafts were accepted, not only rejected
    assert out.target_forwards < len(want) - 1
    if with_store:
        assert out.accepted[0] > 0 and out.target_forwards <= len(want) // 2
