"""The compiled decode path (``TargetRunner(compile=True)``: static KV cache, torch.compile) decodes exactly as the
eager one. The default suite traces it with dynamo's ``eager`` backend (the graph capture and the static cache,
in seconds); the slow tests compile it with inductor."""

from __future__ import annotations

import pytest
import torch
from test_sampling_loop import SAMPLING, V, chi2_vs, exact_joint, PROMPT
from tiny_models import random_eagle3_head, tiny_causal_lm

from headstart.decode.eagle3_drafter import Eagle3Drafter
from headstart.decode.generate import plain_generate, speculative_generate
from headstart.decode.ngram import NgramDrafter
from headstart.decode.target_runner import TargetRunner
from headstart.decode.tree import DynamicTree
from headstart.models.target import Target

BACKENDS = ["eager", pytest.param("inductor", marks=pytest.mark.slow)]


def prompt() -> torch.Tensor:
    phrase = torch.randint(3, 128, (9,), generator=torch.Generator().manual_seed(3))
    return torch.cat([phrase, phrase, phrase[:4]]).unsqueeze(0)


@pytest.fixture(scope="module")
def target():
    return Target(tiny_causal_lm("llama", num_hidden_layers=8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_chains_and_trees_equal_eager_greedy(target, backend):
    torch._dynamo.reset()
    eager, compiled = TargetRunner(target, 96), TargetRunner(target, 96, compile=True, backend=backend)
    p = prompt()
    reference = plain_generate(eager, p, 40, set()).tokens
    assert plain_generate(compiled, p, 40, set()).tokens == reference
    chain = speculative_generate(compiled, NgramDrafter(), p, 40, set(), k=4)
    assert chain.tokens == reference and sum(chain.accepted) > 0  # drafts were accepted: commits moved the cache
    head = random_eagle3_head(target)
    tree = DynamicTree(depth=3, topk=2, total_tokens=6)
    want = speculative_generate(eager, Eagle3Drafter(head, 96), p, 40, set(), k=4, tree=tree)
    got = speculative_generate(compiled, Eagle3Drafter(head, 96), p, 40, set(), k=4, tree=tree)
    assert got.tokens == reference == want.tokens and got.accepted == want.accepted


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_decoding_past_a_sliding_window_equals_eager(backend):
    torch._dynamo.reset()
    target = Target(tiny_causal_lm("gemma2", num_hidden_layers=8, sliding_window=8))
    eager, compiled = TargetRunner(target, 64), TargetRunner(target, 64, compile=True, backend=backend)
    p = prompt()
    reference = plain_generate(eager, p, 30, set()).tokens
    assert speculative_generate(compiled, NgramDrafter(), p, 30, set(), k=3).tokens == reference


def test_a_block_past_the_static_cache_is_refused_by_name(target):
    runner = TargetRunner(target, 24, compile=True, backend="eager")
    with pytest.raises(ValueError, match=r"KV cache overflow: 25 tokens > max_len 24 \(raise --max-len\)"):
        plain_generate(runner, prompt(), 40, set())


@pytest.mark.slow
def test_compiled_speculative_sampling_follows_the_target():
    """Lossless on the compiled path (inductor): chi-square against the warped target's exact joint."""
    torch._dynamo.reset()
    model = tiny_causal_lm("llama", num_hidden_layers=8, vocab_size=V)
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)
    target = Target(model)
    runner = TargetRunner(target, 32, compile=True)
    torch.manual_seed(1)
    head = random_eagle3_head(target, draft_vocab_size=V)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    g = torch.Generator().manual_seed(0)
    pairs = []
    for _ in range(2500):
        out = speculative_generate(runner, Eagle3Drafter(head, 32), PROMPT, 4, set(), k=3, sampling=SAMPLING, generator=g)
        pairs.append((out.tokens[1], out.tokens[2]))
    stat, critical = chi2_vs(pairs, exact_joint(model))
    assert stat < critical
