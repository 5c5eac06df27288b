"""Speculative sampling through the whole loop reproduces the (warped) target distribution."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import tiny_causal_lm

from headstart.decode.confidence import with_threshold
from headstart.decode.draft_model import DraftModelDrafter
from headstart.heads.eagle3.drafter import Eagle3Drafter
from headstart.decode.generate import Sampling, speculative_generate
from headstart.decode.hybrid import HybridDrafter
from headstart.decode.ngram import NgramDrafter
from headstart.decode.target_runner import TargetRunner
from headstart.decode.tree import DynamicTree, StaticTree
from headstart.decode.verify import TOKEN, Verification
from headstart.models.draft_vocab import build_draft_vocab
from headstart.heads.eagle3.module import Eagle3Config, Eagle3Draft
from headstart.heads.medusa.module import MedusaConfig, MedusaHeads
from headstart.models.target import Target

V = 8
SAMPLING = Sampling(temperature=0.9, top_k=6)
PROMPT = torch.tensor([[1, 5, 2, 7, 1, 5]])


@pytest.fixture(scope="module")
def world():
    model = tiny_causal_lm("llama", num_hidden_layers=8, vocab_size=V)
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)  # peaky, context-dependent distributions
    target = Target(model)
    head = Eagle3Draft(Eagle3Config.from_target(model.config, draft_vocab_size=V))
    torch.manual_seed(1)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    head.set_draft_vocab(*build_draft_vocab(torch.ones(V), V))
    head.load_target_embeddings(target.embed_tokens.weight)
    return model, TargetRunner(target, max_len=32), head


def exact_joint(model) -> torch.Tensor:
    """P(t1, t2) of the 2nd and 3rd sampled tokens, marginalised over the 1st: [V, V]."""
    with torch.no_grad():
        probs = lambda ids: SAMPLING.probs(model(ids).logits[:, -1])  # noqa: E731
        p0 = probs(PROMPT)[0]  # [V]
        t0 = torch.arange(V)[:, None]
        p1 = probs(torch.cat([PROMPT.expand(V, -1), t0], 1))  # [V(t0), V(t1)]
        pairs = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # (t0, t1)
        p2 = probs(torch.cat([PROMPT.expand(V * V, -1), pairs], 1)).view(V, V, V)  # [t0, t1, t2]
    return torch.einsum("a,ab,abc->bc", p0, p1, p2)


def chi2_vs(samples: list[tuple[int, int]], joint: torch.Tensor) -> tuple[float, float]:
    """Chi-square statistic (cells with expected < 5 pooled) and its p = 0.001 critical value."""
    counts = torch.zeros(V, V)
    for a, b in samples:
        counts[a, b] += 1
    expected = joint * len(samples)
    assert counts[joint == 0].sum() == 0, "a pair of probability 0 was emitted"
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = obs.numel() - 1
    z = 3.09  # Wilson-Hilferty quantile approximation at p = 0.001
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, critical


def sample_pairs(runner, make_drafter, n: int, seed: int, tree=None, verification: Verification = TOKEN
                 ) -> list[tuple[int, int]]:
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(n):
        out = speculative_generate(runner, make_drafter(), PROMPT, 4, set(), k=3, sampling=SAMPLING, generator=g, tree=tree,
                                   verification=verification)
        pairs.append((out.tokens[1], out.tokens[2]))
    return pairs


def medusa_heads(model) -> MedusaHeads:
    """Random Medusa heads over the small vocab (tests/test_batch_generate.py and test_compiled_decode.py use them)."""
    heads = MedusaHeads(MedusaConfig.from_target(model.config, 3))
    heads.load_target_lm_head(model.lm_head.weight)
    torch.manual_seed(2)
    with torch.no_grad():
        for block in heads.blocks:
            block.layers[0].weight.normal_(0, 0.3)
    return heads


@pytest.mark.nightly  # every head of the catalog: tests/test_catalog.py; here the drafters that are not heads
@pytest.mark.parametrize("verification", ["token", "block"])
@pytest.mark.parametrize("drafter", ["ngram"])
def test_speculative_samples_follow_the_target(world, drafter, verification):
    model, runner, _ = world
    make = {"ngram": NgramDrafter}[drafter]
    stat, critical = chi2_vs(sample_pairs(runner, make, 2500, seed=0, verification=Verification(verification)),
                             exact_joint(model))
    assert stat < critical


@pytest.mark.slow  # 65 s here (2,500 requests); the default suite checks block verification exactly
# (tests/test_block_verification.py) and through the batched loop (tests/test_batch_generate.py)
def test_block_verified_chains_follow_the_target(world):
    """Block verification through the loop (decode/generate.py), with a head that draws its drafts from q: the joint of
    the 2nd and 3rd sampled tokens is the target's, by the chi-square test (every head: tests/test_catalog.py)."""
    model, runner, head = world
    pairs = sample_pairs(runner, lambda: Eagle3Drafter(head, 32), 2500, seed=0, verification=Verification("block"))
    stat, critical = chi2_vs(pairs, exact_joint(model))
    assert stat < critical


@pytest.mark.nightly
@pytest.mark.parametrize(("drafter", "threshold"), [("eagle3", 0.3), ("draft-model", 0.17)])
def test_samples_follow_the_target_when_unsure_chains_stop(world, drafter, threshold):
    """Chains cut where the drafter's probability of its sampled draft (under the warped q it was drawn from) is under
    ``threshold`` (decode/confidence.py; for these random drafters each threshold sits where some first rounds are cut
    and some are not, which the test checks): the length depends on the drafter's side only, so the samples still
    follow the target."""
    model, runner, head = world
    torch.manual_seed(0)  # the draft model whatever ran before: its q sits near the threshold
    small = tiny_causal_lm("llama", num_hidden_layers=2, vocab_size=V)
    make = {"eagle3": lambda: Eagle3Drafter(head, 32), "draft-model": lambda: DraftModelDrafter(small, 32, V)}[drafter]
    cut = with_threshold(make, threshold)
    g = torch.Generator().manual_seed(3)
    firsts = [speculative_generate(runner, cut(), PROMPT, 8, set(), k=3, sampling=SAMPLING, generator=g).proposed[0]
              for _ in range(40)]  # a first round may draft 3: fewer is the rule's cut
    assert 0 < sum(n < 3 for n in firsts) < len(firsts), f"first rounds' drafts {firsts}: the rule is not under test"
    stat, critical = chi2_vs(sample_pairs(runner, cut, 2500, seed=0), exact_joint(model))
    assert stat < critical


@pytest.mark.parametrize("drafter", ["eagle3", "draft-model"])
def test_a_sampled_chain_reads_the_probability_of_the_q_its_draft_was_drawn_from(world, drafter):
    """These random drafters are near uniform over 8 tokens: their raw softmax never reaches 0.5, so greedy chains stop
    after one draft. Sampled at temperature 1e-4, the drawn draft has q near 1 and the chain runs to k -- the rule
    reads the distribution the draft came from (as transformers reads its assistant's processed scores)."""
    model, runner, head = world
    small = tiny_causal_lm("llama", num_hidden_layers=2, vocab_size=V)
    make = {"eagle3": lambda: Eagle3Drafter(head, 32), "draft-model": lambda: DraftModelDrafter(small, 32, V)}[drafter]
    cut = with_threshold(make, 0.5)
    g = torch.Generator().manual_seed(0)
    greedy = [speculative_generate(runner, cut(), PROMPT, 8, set(), k=3).proposed[0]]
    sharp = [speculative_generate(runner, cut(), PROMPT, 8, set(), k=3, sampling=Sampling(temperature=1e-4),
                                  generator=g).proposed[0] for _ in range(5)]
    flat = [speculative_generate(runner, cut(), PROMPT, 8, set(), k=3, sampling=Sampling(temperature=1.0),
                                 generator=g).proposed[0] for _ in range(5)]
    assert greedy == [1] and flat == [1] * 5  # unwarped q is the raw softmax: under 0.5, cut after the first draft
    assert sharp == [3] * 5


class MisreportingDrafter(Eagle3Drafter):
    """Samples its drafts from q but reports a uniform q: verification then accepts too often."""

    def propose_sampled(self, k, sampling, generator=None):
        tokens, q = super().propose_sampled(k, sampling, generator)
        return tokens, torch.full_like(q, 1.0 / q.shape[-1])


@pytest.mark.nightly
def test_misreported_draft_probabilities_are_detected(world):
    model, runner, head = world
    stat, critical = chi2_vs(sample_pairs(runner, lambda: MisreportingDrafter(head, 32), 2500, seed=0), exact_joint(model))
    assert stat > 3 * critical


@pytest.mark.nightly
@pytest.mark.parametrize("drafter", ["draft-model"])  # the catalog's heads: tests/test_catalog.py
@pytest.mark.parametrize("tree", [DynamicTree(depth=3, topk=3, total_tokens=8), StaticTree(((0,), (1,), (0, 0), (1, 0), (0, 0, 0)))])
def test_tree_speculative_samples_follow_the_target(world, drafter, tree):
    model, runner, _ = world
    small = tiny_causal_lm("llama", num_hidden_layers=2, vocab_size=V)
    make = {"draft-model": lambda: DraftModelDrafter(small, 32, V)}[drafter]
    pairs = sample_pairs(runner, make, 2500, seed=0, tree=tree)
    stat, critical = chi2_vs(pairs, exact_joint(model))
    assert stat < critical


@pytest.mark.nightly
def test_ngram_tree_samples_follow_the_target(world):
    """n-gram lookup's trees (decode/ngram.py): deterministic children, verified by one sample per node."""
    model, runner, _ = world
    pairs = sample_pairs(runner, NgramDrafter, 2500, seed=0, tree=DynamicTree(depth=3, topk=3, total_tokens=8))
    stat, critical = chi2_vs(pairs, exact_joint(model))
    assert stat < critical


def test_draft_model_keeps_the_accepted_drafts_it_already_ran_and_equals_a_full_rerun(monkeypatch):
    """After a chain round the draft model keeps the KV of the accepted drafts it ran (no re-run): its next logits
    equal those of a drafter that reads the whole sequence afresh, for any number accepted -- also after a chain that
    stopped early at an unsure draft (``confidence_threshold``: fewer drafts ran through the model; here the rule is
    made to stop after draft ``stop``, so every cut position is tested whatever the random model's probabilities)."""
    from headstart.decode import chain as draft_model  # the chain loop, and the rule it reads, is decode/chain.py's

    small = tiny_causal_lm("llama", num_hidden_layers=2, vocab_size=V).eval()
    prompt = torch.randint(0, V, (1, 9))
    for stop in (None, 1, 2, 3):  # None: the full chain of k = 4
        calls = []
        monkeypatch.setattr(draft_model, "confident",
                            lambda logits, draft, threshold, probs=None: calls.append(draft) or len(calls) != stop)
        for accepted in range(0, (stop or 4) + 1):  # 0..k' drafts accepted, then the bonus token
            calls.clear()
            drafter = DraftModelDrafter(small, 64, V)
            drafter.begin(prompt, None, 7)
            drafts = drafter.propose(4).tolist()
            assert len(drafts) == (stop or 4)
            calls.append("done")  # the rule stops nothing after this chain
            emitted = drafts[:accepted] + [int(torch.randint(0, V, ()))]
            drafter.update(emitted, None)
            assert drafter.runner.length == prompt.shape[1] + 1 + len(emitted)
            fresh = DraftModelDrafter(small, 64, V)
            fresh.begin(torch.cat([prompt, torch.tensor([[7] + emitted[:-1]])], dim=1), None, emitted[-1])
            torch.testing.assert_close(drafter.last_logits, fresh.last_logits, rtol=1e-4, atol=1e-4)
            assert drafter.propose(3).tolist() == fresh.propose(3).tolist()


@pytest.mark.nightly
@pytest.mark.parametrize(("tree", "min_score"), [(None, 0.5), (DynamicTree(depth=3, topk=3, total_tokens=8), 1.5)])
def test_hybrid_samples_follow_the_target(world, tree, min_score):
    """The EAGLE-3 drafter behind n-gram lookup (decode/hybrid.py): rounds drafted by either, chosen by the tokens so
    far; n-gram chains verified as one-hot q, the head's with its q. Each score puts a good share of the rounds with
    either drafter (a tree sums more nodes than a chain of 3)."""
    model, runner, head = world
    made: list[HybridDrafter] = []

    def make() -> HybridDrafter:
        made.append(HybridDrafter(Eagle3Drafter(head, 32), NgramDrafter(), min_score))
        return made[-1]

    stat, critical = chi2_vs(sample_pairs(runner, make, 2500, seed=0, tree=tree), exact_joint(model))
    assert stat < critical
    rounds = {who: sum(h.rounds[who] for h in made) for who in ("ngram", "model")}
    assert min(rounds.values()) > 0.1 * sum(rounds.values()), rounds  # both drafted a good share of the rounds
