"""The benchmark's bookkeeping: Spec-Bench parsing, multi-turn prompts, tau and per-position rates."""

from __future__ import annotations

import json

import pytest
from conftest import CHATML_TEMPLATE, make_tokenizer
from tiny_models import tiny_causal_lm

from headstart.decode.benchmark import Tally, markdown_table, read_questions, run_benchmark
from headstart.decode.generate import Generation
from headstart.decode.ngram import NgramDrafter
from headstart.decode.target_runner import TargetRunner
from headstart.models.target import Target


def test_read_questions_errors_name_the_line(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"question_id": 1, "category": "math", "turns": ["a", "b"]}) + "\n"
                    + json.dumps({"question_id": 2, "turns": "not a list"}) + "\n")
    with pytest.raises(ValueError, match=r"q\.jsonl line 2: expected 'turns'"):
        read_questions(path)


def test_tally_tau_and_acceptance_by_position():
    tally = Tally()
    # Two rounds: 3 of 3 drafts accepted, then 1 of 2; tokens: first + 4 + 2.
    tally.add(Generation(tokens=list(range(7)), target_forwards=2, accepted=[3, 1], proposed=[3, 2]), k=3)
    s = tally.summary()
    assert s["tau"] == pytest.approx(6 / 2)
    assert s["acceptance_by_position"] == [1.0, 0.5, 1.0]  # position 3 was proposed once and accepted once


def test_run_benchmark_multi_turn_and_verification(tmp_path):
    tokenizer = make_tokenizer(CHATML_TEMPLATE, "<|im_end|>")
    model = tiny_causal_lm("llama", num_hidden_layers=8, vocab_size=len(tokenizer))
    runner = TargetRunner(Target(model), max_len=512)
    questions = [{"question_id": 7, "category": "writing", "turns": ["Say hello.", "Again, please."]},
                 {"question_id": 8, "category": "math", "turns": ["What is 2+3?"]}]
    report = run_benchmark(runner, NgramDrafter, tokenizer, questions, k=3, max_new_tokens=12, eos_ids=set(),
                           verify_greedy=True, hf_reference=False, progress=lambda _: None)
    results = report["results"]
    assert report["mismatches"] == []
    assert set(results) == {"writing", "math", "overall"}
    assert results["overall"]["generated_tokens"] == 3 * 12  # three turns of 12 tokens
    assert results["overall"]["tau"] >= 1.0
    assert "| overall |" in markdown_table(results)
