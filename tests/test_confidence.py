"""Chains that stop where the drafter is unsure (decode/confidence.py): the rule, and what it does to real drafters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from headstart.decode.confidence import confident, confident_prefix, with_threshold
from headstart.decode.draft_model import DraftModelDrafter
from headstart.decode.generate import greedy_generate, speculative_generate
from headstart.decode.ngram import NgramDrafter
from headstart.decode.target_runner import TargetRunner
from headstart.heads.registry import drafter_for, load_head
from headstart.models.target import Target, TargetConfig, load_causal_lm, load_tokenizer

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs/demo"


def test_the_rule_keeps_the_first_unsure_draft_and_stops_after_it():
    # probabilities 0.7, 0.2, 0.1 (log of them as logits: softmax returns them)
    logits = torch.tensor([0.7, 0.2, 0.1]).log()
    assert confident(logits, torch.tensor(0), 0.6)
    assert not confident(logits, torch.tensor(0), 0.75)
    assert not confident(logits.view(1, 3), torch.tensor([1]), 0.3)  # a [1, V] row and a [1] id, as EAGLE-3 passes
    assert confident(logits, torch.tensor(2), 0.0)  # threshold 0: always on

    rows = torch.tensor([[0.9, 0.05, 0.05], [0.3, 0.6, 0.1], [0.2, 0.2, 0.6], [0.1, 0.1, 0.8]]).log()
    drafts = rows.argmax(-1)  # probabilities 0.9, 0.6, 0.6, 0.8
    assert confident_prefix(rows, drafts, 0.0) == 4
    assert confident_prefix(rows, drafts, 0.5) == 4
    assert confident_prefix(rows, drafts, 0.7) == 2  # the second (0.6) is kept, the rest dropped
    assert confident_prefix(rows, drafts, 0.95) == 1
    assert confident_prefix(rows[:0], drafts[:0], 0.5) == 0


def test_a_drafter_without_the_rule_is_refused_by_name():
    assert with_threshold(NgramDrafter, 0.0)() is not None  # no threshold: any drafter
    with pytest.raises(ValueError, match="NgramDrafter declares no confidence rule"):
        with_threshold(NgramDrafter, 0.4)()


@pytest.fixture(scope="module")
def demo():
    target = Target.from_pretrained(TargetConfig(path=str(DEMO / "target"), dtype="float32"))
    tokenizer = load_tokenizer(str(DEMO / "target"))
    rows = [json.loads(line) for line in (DEMO / "data/gsm8k_train.jsonl").read_text().splitlines()[:2]]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": r["question"]}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)["input_ids"] for r in rows]
    eos = {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    return target, prompts, eos


@pytest.mark.parametrize("method", ["eagle3", "mtp", "medusa", "draft-model"])
def test_stopping_unsure_chains_keeps_greedy_output_and_drops_the_drafts_least_accepted(demo, method):
    """Same output as plain greedy decoding; shorter chains; and the drafts a chain still proposes are accepted more
    often than when every chain runs to k -- the drafter's confidence tracks what the target accepts."""
    target, prompts, eos = demo
    with_aux = method == "eagle3"
    runner = TargetRunner(target, max_len=512, with_aux=with_aux)
    if method == "draft-model":
        small = load_causal_lm(TargetConfig(path=str(DEMO / "draft-model"), dtype="float32"))
        make = lambda: DraftModelDrafter(small, 512, target.lm_head.weight.shape[0])  # noqa: E731
    else:
        head = load_head(method, str(DEMO / f"{method}-head"), target)
        make = lambda: drafter_for(head, 512)  # noqa: E731
    k, stats = 4, {}
    for threshold in (0.0, 0.6):
        accepted = proposed = full = rounds = 0
        for prompt in prompts:
            out = speculative_generate(runner, with_threshold(make, threshold)(), prompt, 48, eos, k=k)
            assert out.tokens == greedy_generate(runner, prompt, 48, eos).tokens
            accepted += sum(out.accepted)
            proposed += sum(out.proposed)
            full += sum(n == k for n in out.proposed)
            rounds += len(out.proposed)
        stats[threshold] = accepted / proposed, full / rounds
        if threshold == 0:  # every chain runs to k but the last ones, where the length limit leaves less than k
            assert rounds - full <= 2 * len(prompts)
    (rate_all, full_all), (rate_stopped, full_stopped) = stats[0.0], stats[0.6]
    assert full_stopped < full_all - 0.2, f"{method}: chains at 0.6 were cut in {1 - full_stopped:.0%} of rounds"
    assert rate_stopped > rate_all + 0.05, f"{method}: acceptance of proposed drafts {rate_stopped:.2f} vs {rate_all:.2f}"
