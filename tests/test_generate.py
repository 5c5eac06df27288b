"""Speculative generation is token-for-token the target's greedy decoding."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_causal_lm

from headstart.decode.drafter import Drafter
from headstart.decode.generate import greedy_generate, speculative_generate
from headstart.decode.ngram import NgramDrafter
from headstart.decode.target_runner import TargetRunner
from headstart.models.target import Target


@pytest.fixture(scope="module")
def setup():
    model = tiny_causal_lm("llama", num_hidden_layers=8)
    runner = TargetRunner(Target(model), max_len=160)
    # A repetitive prompt, so prompt lookup finds matches and some drafts are accepted.
    phrase = torch.randint(3, 128, (9,), generator=torch.Generator().manual_seed(3))
    prompt = torch.cat([phrase, phrase, phrase[:4]]).unsqueeze(0)
    return model, runner, prompt


def hf_greedy(model, prompt, n):
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, prompt.shape[1]:].tolist()


def test_plain_runner_decoding_equals_hf(setup):
    model, runner, prompt = setup
    out = greedy_generate(runner, prompt, 30, eos_ids=set())
    assert out.tokens == hf_greedy(model, prompt, 30) and out.tau == 1.0


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("max_new", [1, 2, 7, 40])
def test_ngram_speculation_equals_greedy(setup, k, max_new):
    model, runner, prompt = setup
    reference = hf_greedy(model, prompt, max_new)
    out = speculative_generate(runner, NgramDrafter(), prompt, max_new, eos_ids=set(), k=k)
    assert out.tokens == reference
    assert len(out.tokens) == max_new


def test_a_budget_of_no_tokens_is_refused_by_name(setup):
    """The prompt's forward always yields a token: max_new_tokens 0 is an error, not an empty or negative count."""
    _, runner, prompt = setup
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        speculative_generate(runner, NgramDrafter(), prompt, 0, eos_ids=set(), k=3)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        greedy_generate(runner, prompt, 0, eos_ids=set())


def test_ngram_sizes_are_checked():
    with pytest.raises(ValueError, match="1 <= min_ngram <= max_ngram, got 3 and 2"):
        NgramDrafter(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="got 0 and 0"):
        NgramDrafter(max_ngram=0, min_ngram=0)


class OracleDrafter(Drafter):
    """Proposes the true continuation (a test double): every draft is accepted."""

    def __init__(self, continuation: list[int]) -> None:
        self.continuation, self.pos = continuation, 0

    def begin(self, prompt_ids, states, next_token):
        self.pos = 1

    def propose(self, k):
        return torch.tensor(self.continuation[self.pos : self.pos + k], dtype=torch.long)

    def update(self, emitted, states):
        self.pos += len(emitted)


def test_eos_inside_an_accepted_span_stops_exactly_there(setup):
    model, runner, prompt = setup
    reference = hf_greedy(model, prompt, 40)
    spec = speculative_generate(runner, OracleDrafter(reference), prompt, 40, eos_ids=set(), k=5)
    assert spec.tokens == reference and spec.accepted[:3] == [5, 5, 5]
    # Rounds emit tokens 1-6, 7-12, ...: position p is an accepted draft with more tokens after it
    # in its round when p % 6 != 0. Take the first such position whose token is new in the output.
    p = next(p for p in range(1, 40) if p % 6 != 0 and reference.index(reference[p]) == p)
    eos = reference[p]
    expected = reference[: p + 1]
    assert speculative_generate(runner, OracleDrafter(reference), prompt, 40, eos_ids={eos}, k=5).tokens == expected
    assert speculative_generate(runner, NgramDrafter(), prompt, 40, eos_ids={eos}, k=5).tokens == expected
    assert greedy_generate(runner, prompt, 40, eos_ids={eos}).tokens == expected


def test_accepting_drafts_saves_target_forwards(setup):
    _, runner, prompt = setup
    out = speculative_generate(runner, NgramDrafter(), prompt, 40, eos_ids=set(), k=5)
    assert sum(out.accepted) > 0
    assert out.target_forwards == len(out.accepted) < 39
    assert out.tau == pytest.approx((len(out.tokens) - 1) / out.target_forwards) and out.tau > 1.0
