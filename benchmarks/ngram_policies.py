"""Replay n-gram drafting rules over a target's own greedy outputs: tau exactly as decoding would give it (greedy
verification accepts a draft's longest prefix that equals the greedy continuation), and tokens/s modelled from the
target's verify forward measured here for 1..k+1 tokens. One generation serves every rule, so rules compare with no
timing noise between them -- and with two references no loop can beat: transformers' prompt-lookup rule, and an
oracle that drafts exactly the tokens that will be accepted of headstart's proposal (the best any draft-length rule
on that proposal can do).

    python benchmarks/ngram_policies.py --target targets/SmolLM2-135M-Instruct \
        --questions configs/demo/eval/mt_bench.jsonl --per-category 1 --max-new-tokens 128 --out runs/lab-notes.md

The model leaves out what a round costs beyond the verify forward (0.1-0.5 ms per round in headstart's loop,
measured), so modelled tokens/s run above measured ones.
"""

from __future__ import annotations

import argparse
from typing import Callable


from headstart.decode.questions import first_per_category, prompt_ids, read_questions
from headstart.decode.generate import plain_generate
from headstart.decode.ngram import NgramDrafter
from headstart.decode.predict import measure_step_times
from headstart.decode.report import append_section
from headstart.decode.target_runner import TargetRunner
from headstart.models.target import Target, TargetConfig, load_tokenizer

Rule = Callable[[list[int], int], list[int]]


def headstart_rule(max_ngram: int) -> Rule:
    """headstart's ``NgramDrafter``: the latest earlier occurrence of the longest suffix (up to ``max_ngram``), k
    tokens of what followed it."""
    drafter = NgramDrafter(max_ngram)

    def propose(context: list[int], k: int) -> list[int]:
        drafter.context = context
        return drafter.propose(k).tolist()

    return propose


def match_length_rule(max_ngram: int) -> Rule:
    """headstart's proposal cut to min(k, n) tokens after an n-token match: a short match predicts a long
    continuation badly, so a rule that trusts it less might waste fewer verified tokens (it does not: see the table)."""
    by_size = {n: NgramDrafter(n, n) for n in range(1, max_ngram + 1)}

    def propose(context: list[int], k: int) -> list[int]:
        for n in range(max_ngram, 0, -1):
            by_size[n].context = context
            follow = by_size[n].propose(min(k, n)).tolist()
            if follow:
                return follow
        return []

    return propose


def prompt_lookup_rule(eos_ids: set[int]) -> Rule:
    """transformers' prompt lookup as its candidate generator states it: suffixes of 2 then 1 tokens, the earliest
    occurrence with a continuation, k tokens of it, cut before an end-of-sequence token."""

    def propose(context: list[int], k: int) -> list[int]:
        for n in range(min(2, len(context) - 1), 0, -1):
            for start in range(len(context) - n):
                if context[start : start + n] == context[-n:] and context[start + n : start + n + k]:
                    follow = context[start + n : start + n + k]
                    cut = next((i for i, t in enumerate(follow) if t in eos_ids), len(follow))
                    return follow[:cut]
        return []

    return propose


def replay(turns: list[tuple[list[int], list[int]]], rule: Rule, k: int, verify_s: list[float],
           oracle: bool = False, max_new_tokens: int | None = None) -> dict[str, float]:
    """Decode every (prompt, greedy output) turn again with ``rule``'s drafts: rounds, tokens, drafted tokens and
    the verify seconds they cost (``verify_s[n]``: a forward over n + 1 tokens). ``oracle``: draft only the part
    of the rule's proposal that will be accepted. ``max_new_tokens``: the outputs' token budget; a round drafts at
    most what it leaves after the round's own token, as the decoder does (None: no cut)."""
    rounds = tokens = drafted = 0
    seconds = 0.0
    for prompt, out in turns:
        context, i = prompt + out[:1], 1  # the prefill's token comes with the prompt's forward
        while i < len(out):
            draft = rule(list(context), k)
            if max_new_tokens is not None:
                draft = draft[: max(0, max_new_tokens - i - 1)]
            accepted = 0
            while accepted < len(draft) and i + accepted < len(out) and draft[accepted] == out[i + accepted]:
                accepted += 1
            sent = accepted if oracle else len(draft)
            emitted = out[i : i + accepted + 1]
            context += emitted
            i += len(emitted)
            rounds, tokens, drafted, seconds = rounds + 1, tokens + len(emitted), drafted + sent, seconds + verify_s[sent]
    return {"tau": tokens / rounds, "drafted": drafted / rounds, "tok_s": tokens / seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--questions", required=True)
    p.add_argument("--per-category", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", default=None, help="append the table to this markdown file")
    args = p.parse_args()
    target = Target.from_pretrained(TargetConfig(path=args.target, dtype="float32", device="cpu"))
    tokenizer = load_tokenizer(args.target)
    eos = {t for t in [tokenizer.eos_token_id, target.model.generation_config.eos_token_id] if isinstance(t, int)}
    runner = TargetRunner(target, max_len=target.context_length)
    turns = []
    for q in first_per_category(read_questions(args.questions), args.per_category):
        messages = []
        for text in q["turns"]:
            messages.append({"role": "user", "content": text})
            prompt = prompt_ids(tokenizer, messages)
            out = plain_generate(runner, prompt, args.max_new_tokens, eos).tokens
            turns.append((prompt[0].tolist(), out))
            messages.append({"role": "assistant", "content": tokenizer.decode(out, skip_special_tokens=True)})
    max_k = 12
    verify_s = measure_step_times(runner, NgramDrafter(), prompt_ids(tokenizer, messages[:1]), max_k=max_k)["verify_seconds"]
    rules = [("transformers' prompt lookup", prompt_lookup_rule(eos), False)]
    rules += [(f"headstart, n-grams up to {n}, draft k", headstart_rule(n), False) for n in (3, 8)]
    rules += [("headstart, n-grams up to 8, draft min(k, n)", match_length_rule(8), False)]
    rules += [("oracle length of headstart's n-grams up to 8", headstart_rule(8), True)]
    rows = [(name, k, replay(turns, rule, k, verify_s, oracle, args.max_new_tokens))
            for name, rule, oracle in rules for k in (4, 8, 12)]
    reference = rows[0][2]["tok_s"]  # transformers at k = 4, as benchmarks/bench_decode_peers.sh runs it
    body = (f"`{args.questions}`, first {args.per_category} per category (all turns), {len(turns)} greedy outputs of "
            f"`{args.target}` (float32, CPU), max {args.max_new_tokens} new tokens, replayed under each rule. Verify "
            f"forward measured here: {verify_s[0] * 1e3:.1f} ms for 1 token, {verify_s[4] * 1e3:.1f} ms for 5, "
            f"{verify_s[8] * 1e3:.1f} ms for 9, {verify_s[12] * 1e3:.1f} ms for 13. Modelled tokens/s = tokens / the "
            "verify forwards their rounds cost (nothing else counted).\n\n"
            "| rule | k | tau | drafted per round | modelled tokens/s | vs transformers' k=4 |\n|---|---|---|---|---|---|\n")
    body += "".join(f"| {name} | {k} | {r['tau']:.3f} | {r['drafted']:.2f} | {r['tok_s']:.2f} | {r['tok_s'] / reference:.3f}x |\n"
                    for name, k, r in rows)
    print(body)
    if args.out:
        append_section(args.out, "n-gram draft lengths: rules replayed on the target's greedy outputs", body)


if __name__ == "__main__":
    main()
