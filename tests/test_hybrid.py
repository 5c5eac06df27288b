"""The hybrid drafter (decode/hybrid.py): n-gram lookup where it expects enough accepted drafts, the model elsewhere."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_causal_lm

from headstart.heads.eagle3.drafter import Eagle3Drafter
from headstart.decode.generate import greedy_generate, speculative_generate
from headstart.decode.hybrid import HybridDrafter
from headstart.decode.ngram import NgramDrafter
from headstart.decode.ngram_store import NgramStore
from headstart.decode.target_runner import TargetRunner
from headstart.decode.drafter import Capabilities, Drafter
from headstart.decode.tree import DraftTree, DynamicTree
from headstart.models.draft_vocab import build_draft_vocab
from headstart.heads.eagle3.module import Eagle3Config, Eagle3Draft
from headstart.models.target import Target, TargetOutput


class FixedModel(Drafter):
    """A model drafter stand-in: always the same chain and tree, counting its calls."""

    capabilities = Capabilities(trees=("dynamic", "static"))

    def __init__(self) -> None:
        self.calls = 0
        self.updates: list[list[int]] = []
        self.read: list[TargetOutput] = []

    def begin(self, prompt_ids, states, next_token) -> None:
        self.updates.append([next_token])

    def update(self, emitted, states) -> None:
        self.updates.append(list(emitted))
        self.read.append(states)

    def propose(self, k: int) -> torch.Tensor:
        self.calls += 1
        return torch.full((k,), 99)

    def tree_root(self) -> torch.Tensor:
        self.calls += 1
        return torch.tensor([0.0, 5.0, 1.0])  # draft ids = target ids: 1 then 2

    def tree_expand(self, parents, tokens, depth) -> torch.Tensor:
        return torch.tensor([[0.0, 5.0, 1.0]]).expand(tokens.numel(), -1)

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids


def ngram_over(context: list[int]) -> NgramDrafter:
    drafter = NgramDrafter()
    drafter.begin(torch.tensor([context[:-1]]), None, context[-1])
    return drafter


def test_the_score_is_the_drafts_expected_accepted_count_under_the_counts():
    drafter = ngram_over([1, 2, 3, 1, 2, 4, 1, 2])
    tree, score = drafter.scored_tree(DynamicTree(depth=3, topk=2, total_tokens=4), max_depth=10)
    assert tree.tokens.tolist() == [4, 3, 1, 1]  # 4 and 3 at 1/2 each, each one's only child 1: paths of 1/2
    assert score == pytest.approx(4 * 0.5)
    chain, score = drafter.scored_chain(3)
    assert chain.tolist() == [4, 1, 2] and score == pytest.approx(0.5 * 3)  # (1, 2) -> 4 | 3, then certain
    assert drafter.grow_tree(DynamicTree(depth=3, topk=2, total_tokens=4), 10).tokens.tolist() == [4, 3, 1, 1]
    assert ngram_over([5, 6, 7]).scored_chain(4)[1] == 0.0  # nothing repeats: no drafts, nothing expected


def states(*values: float) -> TargetOutput:
    """States whose last hidden state at position j is values[j] (no aux): where they go is checked by value."""
    return TargetOutput(aux_hidden_states=None, last_hidden_state=torch.tensor(values).view(1, -1, 1))


def test_ngram_drafts_a_round_only_from_its_score_on():
    context = [1, 2, 3, 1, 2, 4, 1, 2]  # n-gram lookup's chain of 3: 4 1 2, expecting 1.5 accepted
    for min_score, ngram_rounds in ((1.5, 1), (1.6, 0), (0.0, 1)):
        model = FixedModel()
        hybrid = HybridDrafter(model, NgramDrafter(), min_score)
        hybrid.begin(torch.tensor([context[:-1]]), None, context[-1])
        drafts = hybrid.propose(3).tolist()
        assert drafts == ([4, 1, 2] if ngram_rounds else [99, 99, 99])
        assert hybrid.rounds == {"ngram": ngram_rounds, "model": 1 - ngram_rounds} and model.calls == 1 - ngram_rounds
    hybrid = HybridDrafter(FixedModel(), NgramDrafter(), 0.0)
    hybrid.begin(torch.tensor([[5, 6]]), None, 7)
    assert hybrid.propose(3).tolist() == [99, 99, 99]  # no n-gram drafts: the model's round whatever the score


def test_the_model_reads_the_ngram_rounds_when_it_next_drafts_and_its_own_at_once():
    model = FixedModel()
    hybrid = HybridDrafter(model, NgramDrafter(), min_score=1.0, max_flush=2)
    hybrid.begin(torch.tensor([[1, 2, 3, 1, 2, 4, 1]]), None, 2)
    assert hybrid.propose(3).tolist() == [4, 1, 2]  # n-gram lookup's round
    hybrid.update([4, 1, 2, 3], states(1.0, 2.0, 3.0, 4.0))
    assert hybrid.propose(3).tolist() == [1, 2, 4]  # (1, 2, 3) -> 1 ... again n-gram lookup's
    hybrid.update([1, 5], states(5.0, 6.0))
    assert model.updates == [[2]] and hybrid.ngram.context[-6:] == [4, 1, 2, 3, 1, 5]  # n-gram lookup reads each round
    assert hybrid.propose(3).tolist() == [99, 99, 99]  # (1, 5) never came before: the model's round
    # ... which first read the two n-gram rounds: their 6 tokens in order, at most max_flush a forward
    assert model.updates[1:] == [[4, 1], [2, 3], [1, 5]]
    assert [s.last_hidden_state.flatten().tolist() for s in model.read] == [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    hybrid.update([7], states(7.0))
    assert model.updates[-1] == [7]  # its own round: at once


def test_a_round_with_nothing_to_draft_is_nobodys_and_runs_no_late_update():
    """The loop's last round of a reply asks for 0 drafts: the hybrid drafts nothing, counts no round and leaves the
    n-gram rounds the model has not read unread (a late update there would be forwards for nothing)."""
    model = FixedModel()
    hybrid = HybridDrafter(model, NgramDrafter(), min_score=1.0)
    hybrid.begin(torch.tensor([[1, 2, 3, 1, 2, 4, 1]]), None, 2)
    assert hybrid.propose(3).tolist() == [4, 1, 2]
    hybrid.update([4, 1, 2, 3], states(1.0, 2.0, 3.0, 4.0))
    assert hybrid.propose(0).numel() == 0
    tree = hybrid.grow_tree(DynamicTree(depth=2, topk=2, total_tokens=3), max_depth=0)
    assert tree.size == 0
    assert hybrid.rounds == {"ngram": 1, "model": 0} and model.calls == 0 and model.updates == [[2]]


def test_the_hybrid_refuses_a_static_tree_by_name():
    hybrid = HybridDrafter(FixedModel(), NgramDrafter(), min_score=1.0)
    with pytest.raises(TypeError, match="dynamic trees"):
        hybrid.tree_root()


def test_a_tree_round_is_ngram_lookups_tree_or_the_models_eagle2_tree():
    context = [1, 2, 3, 1, 2, 4, 1, 2]
    spec = DynamicTree(depth=2, topk=2, total_tokens=3)
    for min_score, want in ((1.0, [4, 3, 1]), (2.0, [1, 2, 1])):  # n-gram's 3 nodes expect 1.5 accepted
        hybrid = HybridDrafter(FixedModel(), NgramDrafter(), min_score)
        hybrid.begin(torch.tensor([context[:-1]]), None, context[-1])
        tree = hybrid.grow_tree(spec, max_depth=10)
        assert isinstance(tree, DraftTree) and tree.tokens.tolist() == want


def test_the_model_drafts_its_own_tree_shape_and_ngram_lookup_the_rounds():
    """``model_tree``: the model's rounds grow its own (here shallower) EAGLE-2 tree, n-gram lookup's rounds the round's
    shape; a model tree larger than the round's verify block is refused by name."""
    context = [1, 2, 3, 1, 2, 4, 1, 2]
    spec = DynamicTree(depth=2, topk=2, total_tokens=3)
    hybrid = HybridDrafter(FixedModel(), NgramDrafter(), 2.0, model_tree=DynamicTree(depth=1, topk=2, total_tokens=2))
    hybrid.begin(torch.tensor([context[:-1]]), None, context[-1])
    tree = hybrid.grow_tree(spec, max_depth=10)  # n-gram lookup expects 1.5 < 2.0: the model's round
    assert tree.tokens.tolist() == [1, 2] and tree.max_depth == 1 and hybrid.rounds["model"] == 1
    hybrid.min_score = 1.0
    assert hybrid.grow_tree(spec, max_depth=10).tokens.tolist() == [4, 3, 1]  # n-gram lookup's round: the round's shape
    hybrid.model_tree = DynamicTree(depth=1, topk=4, total_tokens=4)
    with pytest.raises(ValueError, match="must fit the round's verify block of 3"):
        hybrid.grow_tree(spec, max_depth=10)


@pytest.fixture(scope="module")
def world():
    model = tiny_causal_lm("llama", num_hidden_layers=8)
    target = Target(model)
    V = model.config.vocab_size
    head = Eagle3Draft(Eagle3Config.from_target(model.config, draft_vocab_size=V))
    head.set_draft_vocab(*build_draft_vocab(torch.ones(V), V))
    head.load_target_embeddings(target.embed_tokens.weight)
    return target, head


@pytest.mark.parametrize("tree", [None, DynamicTree(depth=4, topk=3, total_tokens=10)])
def test_hybrid_decoding_is_the_targets_greedy_decoding_with_both_drafters_drafting(world, tree):
    target, head = world
    runner = TargetRunner(target, max_len=160)
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 9, 8, 5, 6, 7, 10, 5, 6]])
    want = greedy_generate(runner, prompt, 60, set()).tokens
    store = NgramStore()
    store.add(prompt[0].tolist() + want[:30])  # the reply's first half in the store: n-gram rounds there, model later
    hybrid = HybridDrafter(Eagle3Drafter(head, 160), NgramDrafter(store=store), min_score=1.0)
    out = speculative_generate(runner, hybrid, prompt, 60, set(), k=4, tree=tree)
    assert out.tokens == want
    assert hybrid.rounds["ngram"] > 0 and hybrid.rounds["model"] > 0
    # every round one drafter drafted, but a last round with no room left for a draft (nobody's)
    assert sum(hybrid.rounds.values()) == sum(m > 0 for m in out.proposed)
    alone = speculative_generate(runner, NgramDrafter(store=store), prompt, 60, set(), k=4, tree=tree)
    assert out.accepted[0] == alone.accepted[0] > 0  # the store's first round, as n-gram lookup alone drafts it


def test_a_head_that_reads_rounds_late_and_in_chunks_drafts_as_one_that_read_each_round(world):
    """EAGLE-3's commits are causal pairs in its KV cache: rounds read together, max_flush tokens a forward, leave the
    cache, the last logits and so the next drafts as rounds read one by one."""
    target, head = world
    runner = TargetRunner(target, max_len=64)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 9, 8, 5, 6, 7, 10, 5, 6, 3, 2, 9]])
    _, out = runner.forward(ids)
    prompt, rounds = 6, [[7, 8], [5], [6, 9, 8], [5, 6, 7]]  # nine tokens over four rounds, states of positions 6..14
    each, late = Eagle3Drafter(head, 64), HybridDrafter(Eagle3Drafter(head, 64), NgramDrafter(), 0.0, max_flush=2)
    for drafter in (each, late):
        drafter.begin(ids[:, :prompt], out.select(slice(0, prompt)), int(ids[0, prompt]))
    at = prompt
    for emitted in rounds:
        states = out.select(slice(at, at + len(emitted)))  # position j's state pairs with emitted token j
        each.update(emitted, states)
        late._choose(True)  # an n-gram round: the head reads nothing yet
        late.update(emitted, states)
        at += len(emitted)
    assert late.model.length == prompt  # nothing read so far
    late._choose(False)  # the head's round: it reads all four first
    assert late.model.length == each.length == prompt + 9
    torch.testing.assert_close(late.model.last_logits, each.last_logits)
    torch.testing.assert_close(late.model.keys[:, :, : each.length], each.keys[:, :, : each.length])
    assert late.model.propose(3).tolist() == each.propose(3).tolist()


def test_the_warm_up_runs_the_model_behind_ngram_lookup_once_alone(world):
    """The benchmark's untimed warm-up (Rival.warm_up) decodes the hybrid as it is and, through ``warm_ups``, with the
    model drafting every round: a compiled model's chain or tree graph compiles there even where n-gram lookup would
    draft every warm-up round, not in the first timed round the model drafts."""
    from headstart.decode.measure import Rival

    target, head = world
    runner = TargetRunner(target, max_len=160)
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 9, 8, 5, 6, 7, 10, 5, 6]])
    store = NgramStore()
    store.add(prompt[0].tolist() + greedy_generate(runner, prompt, 30, set()).tokens)  # n-gram lookup drafts it all
    model_rounds = []

    class Counting(Eagle3Drafter):
        def tree_root(self):
            model_rounds.append(1)
            return super().tree_root()

    made: list[HybridDrafter] = []

    def make() -> HybridDrafter:
        made.append(HybridDrafter(Counting(head, 160), NgramDrafter(store=store), min_score=0.0,
                                  model_tree=DynamicTree(depth=2, topk=2, total_tokens=4)))
        return made[-1]

    spec = DynamicTree(depth=4, topk=3, total_tokens=8)
    Rival(runner, make, 4, spec).warm_up(prompt, set(), None, torch.Generator())
    assert made[0].rounds["model"] == 0 and made[0].rounds["ngram"] > 0  # the hybrid alone never ran its model
    assert model_rounds  # ... the warm-up's model-only pass did, in its own tree shape
