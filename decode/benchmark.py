"""Acceptance-length benchmark on Spec-Bench-format questions (chain drafting, greedy).

Each question's turns are asked in order; a later turn sees the target's own earlier answers.
Speculative and plain decoding run on the same runner and prompts, so their tokens/s compare;
HF ``generate`` is timed as an outside reference.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from transformers import PreTrainedTokenizerBase

from headstart.decode.generate import Drafter, Generation, greedy_generate, speculative_generate
from headstart.decode.target_runner import TargetRunner


def read_questions(path: str | Path) -> list[dict]:
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row.get("turns"), list) or not all(isinstance(t, str) for t in row["turns"]):
            raise ValueError(f"{path} line {i + 1}: expected 'turns': [str, ...] (Spec-Bench format)")
        rows.append({"question_id": row.get("question_id", i), "category": row.get("category", "all"), "turns": row["turns"]})
    if not rows:
        raise ValueError(f"{path}: no questions")
    return rows


def first_per_category(questions: list[dict], n: int) -> list[dict]:
    """The first n questions of each category, in file order."""
    counts: dict[str, int] = defaultdict(int)
    chosen = []
    for q in questions:
        if counts[q["category"]] < n:
            chosen.append(q)
            counts[q["category"]] += 1
    return chosen


@dataclass
class Tally:
    tokens: int = 0  # generated tokens counted for tau (the prefill's token excluded)
    forwards: int = 0
    spec_seconds: float = 0.0
    plain_seconds: float = 0.0
    hf_seconds: float = 0.0
    new_tokens: int = 0  # all generated tokens (for tokens/s)
    accepted_at: list[int] = field(default_factory=list)  # rounds accepting >= i drafts, i = 1..k
    proposed_at: list[int] = field(default_factory=list)  # rounds proposing >= i drafts

    def add(self, spec: Generation, k: int) -> None:
        self.tokens += len(spec.tokens) - 1
        self.forwards += spec.target_forwards
        self.new_tokens += len(spec.tokens)
        if not self.accepted_at:
            self.accepted_at, self.proposed_at = [0] * k, [0] * k
        for n, m in zip(spec.accepted, spec.proposed):
            for i in range(k):
                self.accepted_at[i] += n > i
                self.proposed_at[i] += m > i

    def summary(self) -> dict:
        return {
            "tau": self.tokens / max(1, self.forwards),
            "acceptance_by_position": [a / p if p else None for a, p in zip(self.accepted_at, self.proposed_at)],
            "spec_tokens_per_s": self.new_tokens / self.spec_seconds if self.spec_seconds else None,
            "plain_tokens_per_s": self.new_tokens / self.plain_seconds if self.plain_seconds else None,
            "hf_generate_tokens_per_s": self.new_tokens / self.hf_seconds if self.hf_seconds else None,
            "speedup": self.plain_seconds / self.spec_seconds if self.spec_seconds else None,
            "generated_tokens": self.new_tokens,
        }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_benchmark(
    runner: TargetRunner,
    make_drafter: Callable[[], Drafter],
    tokenizer: PreTrainedTokenizerBase,
    questions: list[dict],
    k: int,
    max_new_tokens: int,
    eos_ids: set[int],
    verify_greedy: bool = False,
    hf_reference: bool = True,
    progress: Callable[[str], None] = print,
) -> dict:
    device = next(runner.target.model.parameters()).device
    tallies: dict[str, Tally] = defaultdict(Tally)
    mismatches = []
    for q in questions:
        messages: list[dict[str, str]] = []
        for turn, text in enumerate(q["turns"]):
            messages.append({"role": "user", "content": text})
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                   return_dict=True)["input_ids"].to(device)
            _sync(device)
            t0 = time.perf_counter()
            spec = speculative_generate(runner, make_drafter(), prompt, max_new_tokens, eos_ids, k)
            _sync(device)
            t1 = time.perf_counter()
            plain = greedy_generate(runner, prompt, max_new_tokens, eos_ids)
            _sync(device)
            t2 = time.perf_counter()
            hf_seconds = 0.0
            if hf_reference:
                with torch.no_grad():
                    runner.target.model.generate(prompt, max_new_tokens=len(plain.tokens), min_new_tokens=len(plain.tokens),
                                                 do_sample=False, pad_token_id=tokenizer.pad_token_id or 0)
                _sync(device)
                hf_seconds = time.perf_counter() - t2
            if verify_greedy and spec.tokens != plain.tokens:
                mismatches.append(f"question {q['question_id']} turn {turn + 1}")
            for key in (q["category"], "overall"):
                tally = tallies[key]
                tally.add(spec, k)
                tally.spec_seconds += t1 - t0
                tally.plain_seconds += t2 - t1
                tally.hf_seconds += hf_seconds
            messages.append({"role": "assistant", "content": tokenizer.decode(plain.tokens, skip_special_tokens=True)})
        progress(f"question {q['question_id']} ({q['category']}): tau so far {tallies['overall'].summary()['tau']:.2f}")
    result = {k_: t.summary() for k_, t in tallies.items()}
    return {"results": result, "mismatches": mismatches}


def markdown_table(results: dict) -> str:
    lines = ["| category | tau | acceptance by position | spec tok/s | plain tok/s | speed-up | HF generate tok/s |",
             "|---|---|---|---|---|---|---|"]
    order = sorted(k for k in results if k != "overall") + ["overall"]
    for name in order:
        r = results[name]
        acc = " ".join("-" if a is None else f"{a:.2f}" for a in r["acceptance_by_position"])
        fmt = lambda x, spec="{:.1f}": "-" if x is None else spec.format(x)  # noqa: E731
        lines.append(f"| {name} | {r['tau']:.2f} | {acc} | {fmt(r['spec_tokens_per_s'])} | {fmt(r['plain_tokens_per_s'])} | "
                     f"{fmt(r['speedup'], '{:.2f}x')} | {fmt(r['hf_generate_tokens_per_s'])} |")
    return "\n".join(lines)
