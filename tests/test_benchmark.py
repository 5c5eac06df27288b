"""The measuring loop and its report (decode/measure.py, decode/report.py, decode/questions.py): Spec-Bench parsing,
multi-turn prompts, tau and per-position rates, the paired comparison."""

from __future__ import annotations

import json
import time

import pytest
import torch
from conftest import CHATML_TEMPLATE, make_tokenizer
from tiny_models import random_eagle3_head, tiny_causal_lm

from headstart.heads.eagle3.drafter import Eagle3Drafter
from headstart.decode.measure import Tally, run_benchmark
from headstart.decode.questions import read_questions
from headstart.decode.report import markdown_table, split_table
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
    assert s["drafts_per_round"] == pytest.approx(5 / 2)
    assert s["rounds_cut"] == pytest.approx(1 / 2)  # the second round proposed 2 of k=3


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
    table = markdown_table(results, report["by_prompt_length"])
    assert "| overall |" in table and "| *prompt < 512 tokens* |" in table
    # every turn's prompt is short here: the one bucket holds exactly the overall tally
    assert list(report["by_prompt_length"]) == ["prompt < 512 tokens"]
    assert report["by_prompt_length"]["prompt < 512 tokens"] == results["overall"]
    # The per-round split: the parts cover the round, and the prediction is tau x plain forward / forward costs.
    overall = results["overall"]
    ms = overall["round_ms"]
    assert set(ms) == {"draft", "update", "verify", "other"} and all(v > 0 for v in ms.values())
    spec_seconds_per_round = overall["seconds_per_round"] * 1e3
    assert sum(ms.values()) <= spec_seconds_per_round  # the prefill is the rest of the measured time
    # each turn's prompt: speculative decoding also has the drafter read it, so it costs at least plain decoding's
    # forward over it, give or take timing noise
    prompt = overall["prompt_ms"]
    assert prompt["plain"] > 0 and prompt["speculative"] > 0.5 * prompt["plain"]
    # the clock's parts cover the speculative loop: three turns' prompts and every round
    spec_seconds = overall["generated_tokens"] / overall["spec_tokens_per_s"]
    rounds = spec_seconds / overall["seconds_per_round"]
    covered = (3 * prompt["speculative"] + rounds * sum(ms.values())) / 1e3
    assert 0.8 * spec_seconds <= covered <= 1.001 * spec_seconds
    assert overall["predicted_speedup"] > 0  # its formula: test_a_batch_is_predicted_from_its_forward_seconds_...
    assert report["speedup"] == overall["speedup"] and report["predicted_speedup"] == overall["predicted_speedup"]
    assert "| overall |" in split_table(results)


@pytest.mark.parametrize("batch_size", [1, 2])
def test_a_new_prompt_length_costs_neither_timing(batch_size, monkeypatch):
    """Speculative decoding runs first each turn: without the untimed pass over the prompt, the first-call cost of
    every new prompt length (on a GPU: allocator growth, kernel choice) would land in its prompt time and never in
    plain decoding's. The clock is a fake one (every reading 1 us later, a forward of a new shape 0.2 s), so the
    property is tested without timing anything: on a busy machine the real clock's noise would be the test."""
    from headstart.decode.batch_generate import RaggedRunner

    now = [0.0]

    def fake_clock() -> float:
        now[0] += 1e-6
        return now[0]

    monkeypatch.setattr(time, "perf_counter", fake_clock)
    seen: set[tuple[int, ...]] = set()
    for cls in (TargetRunner, RaggedRunner):
        def cold_forward(self, input_ids, *args, _forward=cls.forward, **kwargs):
            if tuple(input_ids.shape) not in seen:
                seen.add(tuple(input_ids.shape))
                now[0] += 0.2
            return _forward(self, input_ids, *args, **kwargs)
        monkeypatch.setattr(cls, "forward", cold_forward)
    tokenizer = make_tokenizer(CHATML_TEMPLATE, "<|im_end|>")
    runner = TargetRunner(Target(tiny_causal_lm("llama", num_hidden_layers=8, vocab_size=len(tokenizer))), max_len=256)
    questions = [{"question_id": i, "category": "writing", "turns": [f"Say hello {'again ' * i}.", "Once more."]}
                 for i in range(2)]
    report = run_benchmark(runner, NgramDrafter, tokenizer, questions, k=3, max_new_tokens=6, eos_ids=set(),
                           hf_reference=False, progress=lambda _: None, batch_size=batch_size)
    prompt = report["results"]["overall"]["prompt_ms"]
    assert len(seen) > 2  # the prompts had new lengths to pay for
    assert prompt["speculative"] < 1 and prompt["plain"] < 1, prompt  # no 200 ms first call in either timing


def test_a_batch_is_predicted_from_its_forward_seconds_not_from_tau():
    """Batched, the rounds last as long as the slowest row, and the prompts are a forward speculation cannot shorten:
    two rows of 10 tokens, one accepting everything (3 rounds), one nothing (9 rounds), are 9 batch rounds either way.
    The prediction is tokens per second of forwards against plain decoding's, (20 / (0.1 + 0.9 s)) / (20 / (0.1 +
    1.8 s)) = 1.9, where tau x plain forward / forwards per round (tau 1.5) would say 1.5."""
    from headstart.decode.clock import RoundClock
    from headstart.decode.generate import Generation

    tally = Tally()
    tally.add(Generation(list(range(10)), target_forwards=3, accepted=[2, 2, 2], proposed=[2, 2, 2]), 2)
    tally.add(Generation(list(range(10)), target_forwards=9, accepted=[0] * 9, proposed=[2] * 9), 2)
    spec, plain = RoundClock(torch.device("cpu")), RoundClock(torch.device("cpu"))
    spec.seconds.update(prefill=0.1, draft=0.2, update=0.1, verify=0.6, other=0.1)
    plain.seconds.update(prefill=0.1, verify=1.8)
    tally.add_seconds(spec, plain, spec_rounds=9, plain_forwards=9)  # batch forwards: 9 of each
    tally.plain_tokens, tally.spec_seconds, tally.plain_seconds = 20, 1.1, 1.9
    s = tally.summary()
    assert s["tau"] == pytest.approx(18 / 12)
    assert s["predicted_speedup"] == pytest.approx(1.9)
    assert s["speedup"] == pytest.approx(1.9 / 1.1)  # the 0.1 s of "other": measured / predicted 1 / 1.1


def test_prompts_fall_into_length_buckets():
    from headstart.decode.measure import prompt_bucket

    assert [prompt_bucket(n) for n in (1, 511, 512, 2047, 2048, 30000)] == [
        "prompt < 512 tokens", "prompt < 512 tokens", "prompt 512-2k tokens", "prompt 512-2k tokens",
        "prompt > 2k tokens", "prompt > 2k tokens"]


def test_run_benchmark_tree_draft_model_and_plot(tmp_path):
    from headstart.decode.report import plot_acceptance
    from headstart.decode.draft_model import DraftModelDrafter
    from headstart.decode.tree import DynamicTree

    tokenizer = make_tokenizer(CHATML_TEMPLATE, "<|im_end|>")
    model = tiny_causal_lm("llama", num_hidden_layers=8, vocab_size=len(tokenizer))
    small = tiny_causal_lm("llama", num_hidden_layers=2, vocab_size=len(tokenizer))
    runner = TargetRunner(Target(model), max_len=512)
    questions = [{"question_id": 7, "category": "writing", "turns": ["Say hello.", "Again, please."]}]
    report = run_benchmark(runner, lambda: DraftModelDrafter(small, 512, len(tokenizer)), tokenizer, questions, k=0,
                           max_new_tokens=12, eos_ids=set(), verify_greedy=True, hf_reference=False,
                           progress=lambda _: None, tree=DynamicTree(depth=3, topk=2, total_tokens=6))
    assert report["mismatches"] == []
    assert len(report["results"]["overall"]["acceptance_by_position"]) == 3  # one rate per tree depth
    plot_acceptance(report["results"], tmp_path / "a.png", "test")
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sampling_benchmark_refuses_greedy_verification():
    from headstart.decode.generate import Sampling

    with pytest.raises(ValueError, match="cannot be combined with sampling"):
        run_benchmark(None, NgramDrafter, None, [], k=2, max_new_tokens=4, eos_ids=set(), verify_greedy=True,
                      sampling=Sampling(0.7))


def test_speedup_prediction_by_hand():
    from headstart.decode.predict import predict_speedups, recommend_k

    # A_1 = 0.8, A_2 = 0.5; target forward 10 ms for 1 token, +1 ms per extra token; draft 2 ms per step.
    rows = predict_speedups([0.8, 0.5, None], [0.010, 0.011, 0.012, 0.013], [0.002, 0.004, 0.006])
    assert [r["tau"] for r in rows] == pytest.approx([1.8, 2.3, 2.3])
    assert rows[0]["speedup"] == pytest.approx(1.8 * 0.010 / (0.002 + 0.011))
    assert rows[1]["speedup"] == pytest.approx(2.3 * 0.010 / (0.004 + 0.012))
    assert recommend_k(rows) == 2  # k = 3 adds cost and no accepted tokens


def test_a_base_model_without_chat_template_is_prompted_with_plain_text():
    """A base model (no chat template) gets the turns' texts joined by blank lines, with its BOS; the answer so
    far is part of the next turn's prompt, as with a template."""
    import copy

    from tokenizers import processors

    from headstart.decode.questions import prompt_ids

    chat = make_tokenizer(CHATML_TEMPLATE, "<|im_end|>")
    base = copy.deepcopy(chat)
    base.chat_template = None
    bos = base.convert_tokens_to_ids("<|im_start|>")
    base._tokenizer.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)])
    messages = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Again."}]
    ids = prompt_ids(base, messages)[0].tolist()
    assert ids[0] == bos and base.decode(ids[1:]) == "Say hello.\n\nHello.\n\nAgain.\n\n"
    templated = prompt_ids(chat, messages)[0].tolist()
    assert chat.decode(templated).endswith("<|im_start|>assistant\n") and templated != ids


def test_transformers_assisted_generation_and_prompt_lookup_run_in_the_same_benchmark():
    """transformers' own speculative decoding on the same prompts: greedy-exact against headstart's plain decoding,
    and tau counted from its target calls -- an assistant identical to the target accepts every draft."""
    import copy

    from headstart.decode.hf_peers import HFSpeculation

    tokenizer = make_tokenizer(CHATML_TEMPLATE, "<|im_end|>")
    model = tiny_causal_lm("llama", num_hidden_layers=8, vocab_size=len(tokenizer)).eval()
    runner = TargetRunner(Target(model), max_len=512)
    questions = [{"question_id": 1, "category": "writing", "turns": ["Say hello.", "Again, please."]}]
    twin = HFSpeculation(model, 3, assistant=copy.deepcopy(model))
    report = run_benchmark(runner, None, tokenizer, questions, k=3, max_new_tokens=12, eos_ids=set(), verify_greedy=True,
                           hf_reference=False, progress=lambda _: None, own_loop=twin)
    assert report["mismatches"] == []
    overall = report["results"]["overall"]
    assert overall["generated_tokens"] == 2 * 12
    assert overall["tau"] == pytest.approx(4.0)  # per turn: 4 + 4 + 4 tokens in 3 calls, the first also the prefill
    assert overall["round_ms"] is None and report["speedup"] > 0  # one call: no split, but a measured speed-up
    lookup = HFSpeculation(model, 3, prompt_lookup=True)
    report = run_benchmark(runner, None, tokenizer, questions, k=3, max_new_tokens=12, eos_ids=set(), verify_greedy=True,
                           hf_reference=False, progress=lambda _: None, own_loop=lookup)
    assert report["mismatches"] == [] and 1.0 <= report["results"]["overall"]["tau"] <= 4.0
    with pytest.raises(ValueError, match="one of them"):
        HFSpeculation(model, 3)


def test_the_warm_up_reaches_the_full_tree_depth(monkeypatch):
    """The untimed warm-up decodes far enough for a first round at the tree's full depth: a compiled tree's graph is
    compiled per depth (decode/static_blocks.py TreeGraph), and a deeper tree than the warm-up's would compile in a
    timed round."""
    import headstart.decode.measure as measure
    from headstart.decode.tree import DynamicTree

    calls = []
    real = measure.speculative_generate

    def spy(runner, drafter, prompt, max_new_tokens, *args, **kwargs):
        calls.append(max_new_tokens)
        return real(runner, drafter, prompt, max_new_tokens, *args, **kwargs)

    monkeypatch.setattr(measure, "speculative_generate", spy)
    tokenizer = make_tokenizer(CHATML_TEMPLATE, "<|im_end|>")
    target = Target(tiny_causal_lm("llama", num_hidden_layers=8, vocab_size=len(tokenizer)))
    runner = TargetRunner(target, max_len=256, with_aux=True)
    head = random_eagle3_head(target)
    questions = [{"question_id": 0, "category": "writing", "turns": ["Say hello."]}]
    run_benchmark(runner, lambda: Eagle3Drafter(head, 256), tokenizer, questions, k=3, max_new_tokens=4, eos_ids=set(),
                  hf_reference=False, progress=lambda _: None, tree=DynamicTree(depth=9, topk=2, total_tokens=6))
    assert calls[0] >= 9 + 2  # the warm-up: a first round's budget of 9 levels (its drafts + the bonus token)


def test_a_second_method_decodes_every_turn_in_the_same_run_taking_turns_at_going_first(monkeypatch):
    """run_benchmark(versus=Rival(...)): a second method decodes every turn beside the first, the two alternating which
    goes first; each gets the report a run of its own would give (same tau and tokens, greedy), and the paired
    comparison has one tokens/s ratio per turn."""
    import headstart.decode.measure as measure
    from headstart.decode.measure import Rival
    from headstart.decode.hf_peers import HFSpeculation

    tokenizer = make_tokenizer(CHATML_TEMPLATE, "<|im_end|>")
    model = tiny_causal_lm("llama", num_hidden_layers=8, vocab_size=len(tokenizer)).eval()
    runner = TargetRunner(Target(model), max_len=512)
    questions = [{"question_id": 1, "category": "writing", "turns": ["Say hello.", "Again, please."]},
                 {"question_id": 2, "category": "math", "turns": ["What is 2+3?"]}]
    timed: list[str] = []  # who decoded each timed turn (12 new tokens; the warm-up asks 8, the prompt pass 1)
    real = measure.speculative_generate

    def spy(runner, drafter, prompt, max_new_tokens, *args, **kwargs):
        timed.extend(["ngram"] if max_new_tokens == 12 else [])
        return real(runner, drafter, prompt, max_new_tokens, *args, **kwargs)

    lookup = HFSpeculation(model, 3, prompt_lookup=True)

    def timed_lookup(prompt, max_new_tokens, *args):
        timed.extend(["hf"] if max_new_tokens == 12 else [])
        return lookup(prompt, max_new_tokens, *args)

    kwargs = dict(k=3, max_new_tokens=12, eos_ids=set(), verify_greedy=True, hf_reference=False, progress=lambda _: None)
    with monkeypatch.context() as m:
        m.setattr(measure, "speculative_generate", spy)
        report = run_benchmark(runner, NgramDrafter, tokenizer, questions, **kwargs,
                               versus=Rival(TargetRunner(Target(model), max_len=512), None, 3, own_loop=timed_lookup))
    # question 1: ngram first on its first turn, hf on its second; question 2 (index 1, turn 0): hf first
    assert timed == ["ngram", "hf", "hf", "ngram", "hf", "ngram"]
    alone = run_benchmark(runner, NgramDrafter, tokenizer, questions, **kwargs)
    assert report["results"]["overall"]["tau"] == alone["results"]["overall"]["tau"]
    assert report["mismatches"] == [] and report["versus"]["mismatches"] == []
    peer = run_benchmark(runner, None, tokenizer, questions, **kwargs, own_loop=lookup)
    assert report["versus"]["results"]["overall"]["tau"] == peer["results"]["overall"]["tau"]
    assert report["versus"]["results"]["overall"]["generated_tokens"] == 3 * 12
    paired = report["paired"]
    assert paired["turns"] == 3 and len(paired["ratios"]) == 3
    first, second = report["results"]["overall"], report["versus"]["results"]["overall"]
    assert paired["overall_ratio"] == pytest.approx(first["spec_tokens_per_s"] / second["spec_tokens_per_s"])
    assert min(paired["ratios"]) <= paired["median_ratio"] <= max(paired["ratios"])
    with pytest.raises(ValueError, match="a second method"):
        run_benchmark(runner, NgramDrafter, tokenizer, questions, **kwargs, batch_size=2,
                      versus=Rival(runner, NgramDrafter, 3))


def test_paired_summary_by_hand():
    from headstart.decode.report import paired_line, paired_summary

    s = paired_summary([2.0, 1.0, 3.0, 4.0], [1.0, 2.0, 3.0, 1.0], 1.25)
    assert s["ratios"] == [2.0, 0.5, 1.0, 4.0] and s["turns"] == 4 and s["first_faster"] == 2  # in turn order
    assert s["median_ratio"] == pytest.approx(1.5) and s["quartiles"] == pytest.approx([0.875, 2.5])
    assert paired_line(s, "a", "b") == ("Paired in one process (4 turns, the two taking turns at decoding first): a / b "
                                        "tokens/s 1.250x over all turns, turn by turn median 1.500x (quartiles "
                                        "0.875-2.500x); a faster in 2 of 4 turns.")
    assert paired_summary([], [], None)["turns"] == 0 and paired_line(paired_summary([], [], None), "a", "b") == ""


def test_per_category_applies_before_the_limit():
    """``--per-category 1 --limit 3``: the first question of each of three categories (MT-bench's first two questions
    are both 'writing': the limit first would leave one question)."""
    from pathlib import Path

    from headstart.decode.questions import decode_setup

    repo = Path(__file__).resolve().parents[1]
    questions = str(repo / "configs/demo/eval/mt_bench.jsonl")
    picked = decode_setup(str(repo / "configs/demo/target"), None, questions, limit=3, per_category=1).questions
    every = read_questions(questions)
    firsts = [q for i, q in enumerate(every) if q["category"] not in {p["category"] for p in every[:i]}]
    assert [q["question_id"] for q in picked] == [q["question_id"] for q in firsts[:3]]
    assert len({q["category"] for q in picked}) == 3
