"""Check an exported head before deploying it: what a server would load wrong without saying so.

    python scripts/check_head.py --head runs/eagle3/final --target /models/Llama-3.1-8B-Instruct
    python scripts/check_head.py --head runs/eagle3/final --target ... --questions configs/demo/eval/mt_bench.jsonl

Reads any head headstart exports (EAGLE-3 flat or speculators, Medusa, MTP) and prints one line per
problem, naming the file and the key (heads/exports.py lists what is checked); exits 1 on any.
With ``--questions`` it also decodes the first turns of a few questions with headstart's decoder
(greedy chain of --k drafts, output checked equal to plain greedy decoding) and prints tau, so a head
that loads but accepts nothing shows up here and not in production.
"""

from __future__ import annotations

import argparse
import sys


from headstart.heads.exports import check_head
from headstart.models.head import DEFAULT_SPECULATIVE_TOKENS
from headstart.decode.measure import run_benchmark
from headstart.decode.questions import decode_setup
from headstart.scripts.benchmark import build_method, build_parser, check_args
from headstart.scripts.command import check_at_least, entry_point, refusals


def measure_tau(head_dir: str, head: str, target_path: str, questions: str, limit: int, k: int, max_new_tokens: int,
                allow_other_target: bool) -> dict:
    """The head decoding the first turns of ``limit`` questions in greedy chains of ``k``, built as ``headstart bench``
    builds ``--method HEAD`` (the one catalog of drafting methods), its output checked against plain greedy."""
    p = build_parser()
    args = p.parse_args(["--target", target_path, "--method", head, "--draft", head_dir, "--questions", questions,
                         "--num-speculative-tokens", str(k), "--max-new-tokens", str(max_new_tokens), "--out", "-"]
                        + (["--allow-other-target"] if allow_other_target else []))
    check_args(p, args)
    setup = decode_setup(target_path, None, questions, limit)
    method = build_method(p, args, setup)
    qs = [dict(q, turns=q["turns"][:1]) for q in setup.questions]
    report = run_benchmark(method.runner, method.make, setup.tokenizer, qs, k, max_new_tokens, setup.eos,
                           verify_greedy=True, hf_reference=False, progress=lambda _: None)
    return {**report["results"]["overall"], "mismatches": report["mismatches"]}


@refusals
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", required=True, help="the exported head's directory")
    p.add_argument("--target", required=True, help="the target's HF directory, as the server will load it")
    p.add_argument("--questions", default=None, help="Spec-Bench-format JSONL: also decode and print tau")
    p.add_argument("--limit", type=int, default=4, help="questions decoded with --questions")
    p.add_argument("--k", type=int, default=DEFAULT_SPECULATIVE_TOKENS, help="drafts per round with --questions")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--min-tau", type=float, default=1.2,
                   help="with --questions: tau below this is reported as a problem (a head that accepts nothing has 1.0)")
    p.add_argument("--allow-other-target", action="store_true",
                   help="do not count a head trained for another target as a problem")
    args = p.parse_args(argv)
    check_at_least(limit=(args.limit, 1), k=(args.k, 1), max_new_tokens=(args.max_new_tokens, 1))
    try:
        what, problems, notes = check_head(args.head, args.target, args.allow_other_target)
    except (OSError, ValueError) as err:  # the target itself cannot be read
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"{args.head}: {what}")
    for note in notes:
        print(f"note: {note}")
    for problem in problems:
        print(f"problem: {problem}")
    if args.questions and not problems:
        try:
            tally = measure_tau(args.head, what.split()[0], args.target, args.questions, args.limit, args.k,
                                args.max_new_tokens, args.allow_other_target)
        except Exception as err:  # headstart's own decoder refused or failed on it: that is the finding
            problems.append(f"decoding it failed: {type(err).__name__}: {err}")
            print(f"problem: {problems[-1]}")
            print(f"{len(problems)} problem(s)")
            return 1
        print(f"tau {tally['tau']:.2f} (greedy chain k={args.k}, {args.limit} questions' first turns, "
              f"{args.max_new_tokens} new tokens)")
        if tally["mismatches"]:
            problems.append(f"decoding differs from plain greedy decoding at {tally['mismatches']}")
            print(f"problem: {problems[-1]}")
        if tally["tau"] < args.min_tau:
            problems.append(f"tau {tally['tau']:.2f} < {args.min_tau}: the head loads but accepts (almost) nothing")
            print(f"problem: {problems[-1]}")
    print(f"{len(problems)} problem(s)" if problems else "ok: no problems found")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(entry_point(main))
