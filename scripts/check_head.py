"""Check an exported head before deploying it: what a server would load wrong without saying so.

    python scripts/check_head.py --head runs/eagle3/final --target /models/Llama-3.1-8B-Instruct
    python scripts/check_head.py --head runs/eagle3/final --target ... --questions configs/demo/eval/mt_bench.jsonl

Reads any head headstart exports (EAGLE-3 flat or speculators, Medusa, MTP) and prints one line per
problem, naming the file and the key (models/head_check.py lists what is checked); exits 1 on any.
With ``--questions`` it also decodes the first turns of a few questions with headstart's decoder
(greedy chain of --k drafts, output checked equal to plain greedy decoding) and prints tau, so a head
that loads but accepts nothing shows up here and not in production.
"""

from __future__ import annotations

import argparse
import sys

import torch

from headstart.models.head_check import check_head
from headstart.models.head import DEFAULT_SPECULATIVE_TOKENS


def measure_tau(head_dir: str, head: str, target_path: str, questions: str, limit: int, k: int, max_new_tokens: int,
                allow_other_target: bool) -> dict:
    from headstart.decode.benchmark import read_questions, run_benchmark
    from headstart.decode.target_runner import TargetRunner
    from headstart.models.registry import drafter_for, load_head
    from headstart.models.target import Target, TargetConfig, load_tokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = Target.from_pretrained(TargetConfig(path=target_path, dtype="bfloat16" if device == "cuda" else "float32",
                                                 device=device))
    tokenizer = load_tokenizer(target_path)
    model = load_head(head, head_dir, target, allow_other_target).to(device=device, dtype=target.lm_head_weight.dtype)
    runner = TargetRunner(target, max_len=target.context_length, with_aux=model.needs.aux_hidden_states)
    eos = {t for t in [tokenizer.eos_token_id, target.model.generation_config.eos_token_id] if isinstance(t, int)}
    qs = [dict(q, turns=q["turns"][:1]) for q in read_questions(questions)[:limit]]
    report = run_benchmark(runner, lambda: drafter_for(model, target.context_length), tokenizer, qs, k, max_new_tokens, eos,
                           verify_greedy=True, hf_reference=False, progress=lambda _: None)
    return {**report["results"]["overall"], "mismatches": report["mismatches"]}


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
    sys.exit(main())
