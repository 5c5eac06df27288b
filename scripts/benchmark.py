"""Measure a drafter on Spec-Bench-format questions: tau, per-position acceptance, speed-up.

    python scripts/benchmark.py --target configs/demo/target --method eagle3 --draft configs/demo/eagle3-head \
        --questions configs/demo/eval/mt_bench.jsonl --num-speculative-tokens 4 --max-new-tokens 128 \
        --verify-greedy --out runs/bench-eagle3

Chain drafting with greedy verification (trees, sampling and the draft-model drafter are not built yet).
Writes results.json and results.md to --out; --benchmarks FILE also appends the table there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from bench_common import append_section
from headstart.decode.benchmark import first_per_category, markdown_table, read_questions, run_benchmark
from headstart.decode.eagle3_drafter import Eagle3Drafter
from headstart.decode.ngram import NgramDrafter
from headstart.decode.target_runner import TargetRunner
from headstart.models.eagle3 import Eagle3Draft
from headstart.models.target import Target, TargetConfig, load_tokenizer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--method", choices=["eagle3", "ngram"], required=True)
    p.add_argument("--draft", help="EAGLE-3 head directory (flat server layout)")
    p.add_argument("--questions", required=True)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--limit", type=int, default=None, help="only the first N questions")
    p.add_argument("--per-category", type=int, default=None, help="only the first N questions of each category")
    p.add_argument("--dtype", default=None, help="target dtype (default bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--verify-greedy", action="store_true", help="exit non-zero if speculative output differs from plain")
    p.add_argument("--no-hf-reference", action="store_true", help="skip timing HF generate")
    p.add_argument("--out", required=True)
    p.add_argument("--benchmarks", default=None, help="append the table to this markdown file")
    args = p.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    target = Target.from_pretrained(TargetConfig(path=args.target, dtype=dtype, device=device))
    tokenizer = load_tokenizer(args.target)
    questions = read_questions(args.questions)[: args.limit]
    if args.per_category:
        questions = first_per_category(questions, args.per_category)
    eos = {t for t in [tokenizer.eos_token_id, target.model.generation_config.eos_token_id] if isinstance(t, int)}
    max_len = 4096
    runner = TargetRunner(target, max_len=max_len)
    if args.method == "eagle3":
        if not args.draft:
            p.error("--method eagle3 needs --draft")
        head = Eagle3Draft.from_pretrained(args.draft, target_embeddings=target.embed_tokens.weight).to(device)
        head.config.check_target(target.config)
        make = lambda: Eagle3Drafter(head, max_len)  # noqa: E731
    else:
        make = NgramDrafter
    report = run_benchmark(runner, make, tokenizer, questions, args.num_speculative_tokens, args.max_new_tokens, eos,
                           verify_greedy=args.verify_greedy, hf_reference=not args.no_hf_reference)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(report["results"])
    (out / "results.json").write_text(json.dumps({"args": vars(args), **report}, indent=2))
    (out / "results.md").write_text(table + "\n")
    print(table)
    if args.benchmarks:
        append_section(args.benchmarks, f"Speculative decoding: {args.method}, chain k={args.num_speculative_tokens}, greedy",
                       f"{len(questions)} questions of `{args.questions}` (all turns), max {args.max_new_tokens} new tokens, "
                       f"target `{args.target}` ({dtype}). tau = tokens per target forward, bonus included; acceptance by "
                       "position i = share of rounds that accepted at least i drafts (of those that proposed at least i); "
                       "speed-up = plain / speculative time on the same runner.\n\n" + table)
    if report["mismatches"]:
        print("speculative output differs from plain greedy decoding at: " + ", ".join(report["mismatches"]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
