"""Regenerate every assistant turn of conversation files with the target (trainer/regenerate.py).

    python scripts/regenerate_data.py --target /models/Llama-3.1-8B-Instruct --data chats.jsonl \
        --output data/regenerated --max-new-tokens 2048 --batch-size 16
    torchrun --nproc_per_node 8 scripts/regenerate_data.py --config my_recipe.yaml --output data/regen
    python scripts/regenerate_data.py --backend openai --endpoint http://localhost:8000 \
        --model /models/Llama-3.1-8B-Instruct --data chats.jsonl --output data/regen --concurrency 64

``--config`` takes the target and the data files (and their format) from a training recipe. Greedy by
default; ``--temperature 0.7 --top-p 0.95`` samples. The output directory's ``regenerated.jsonl`` is
what training reads (``data.files: [data/regen/regenerated.jsonl]``); a killed job is resumed by
running the same command again with --resume.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from headstart.trainer.regenerate import (
    PLAN_VERSION,
    Summary,
    check_plan,
    concatenate,
    files_sha256,
    missing_shards,
    read_sources,
    run_shards,
)
from headstart.trainer.reply_backends import HFBackend, OpenAIBackend, SamplingSettings, ServerDown
from headstart.trainer.config import load_config
from headstart.models.target import TargetConfig, load_causal_lm, load_tokenizer
from headstart.models.provenance import fingerprint
from headstart.trainer.distributed import barrier, init_distributed
from headstart.trainer.errors import report_error
from headstart.trainer.output_dir import JOB_PLAN, claim_output_dir
from headstart.scripts.command import entry_point, refusals


def parse(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="training recipe: its target.path, data.files and data.format")
    p.add_argument("--target", help="the target's HF directory (hf backend; with openai, only recorded)")
    p.add_argument("--data", nargs="+", help=".json/.jsonl/.parquet conversation files")
    p.add_argument("--output", required=True, help="output directory (resumable)")
    p.add_argument("--resume", action="store_true", help="continue the job in --output (skips its finished shards)")
    p.add_argument("--overwrite", action="store_true", help="move the job in --output aside (to <output>.old-<time>) and start again")
    p.add_argument("--format", default=None, choices=["sharegpt", "messages", "instruction", "gsm8k"],
                   help="row format of every file (default: detected per file)")
    p.add_argument("--skip-bad-rows", action="store_true", help="skip and count malformed rows instead of stopping")
    p.add_argument("--limit", type=int, default=None, help="regenerate only the first N conversations")
    p.add_argument("--rows-per-file", type=int, default=None,
                   help="read only the first N rows of each file (a sample of every source, not only the first file)")
    p.add_argument("--backend", choices=["hf", "openai"], default="hf")
    p.add_argument("--batch-size", type=int, default=16, help="hf: conversations per generate call")
    p.add_argument("--dtype", default=None, help="hf: bfloat16 | float16 | float32 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--endpoint", help="openai: the server's base URL, e.g. http://localhost:8000")
    p.add_argument("--model", help="openai: the served model's name (default: --target)")
    p.add_argument("--concurrency", type=int, default=16, help="openai: requests in flight")
    p.add_argument("--retries", type=int, default=5, help="openai: retries of a request (exponential back-off)")
    p.add_argument("--backoff", type=float, default=1.0, help="openai: seconds before the first retry (doubling after)")
    p.add_argument("--timeout", type=float, default=600.0, help="openai: seconds a request may take")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="openai: bearer token (default $OPENAI_API_KEY)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rows-per-shard", type=int, default=64, help="conversations per output shard (the unit of resume)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.config:
        if not Path(args.config).is_file():
            p.error(f"--config {args.config}: no such file")
        recipe = load_config(args.config)
        args.target = args.target or recipe.target.path
        args.data = args.data or list(recipe.data.files)
        args.format = args.format or recipe.data.format
    if not args.data:
        p.error("give --data (or --config)")
    if args.backend == "hf" and not args.target:
        p.error("the hf backend needs --target (or --config)")
    if args.backend == "openai" and not args.endpoint:
        p.error("the openai backend needs --endpoint")
    if args.backend == "openai" and not (args.model or args.target):
        p.error("the openai backend needs --model (the served model's name)")
    return args


def backend_for(args, sampling: SamplingSettings, device: torch.device):
    if args.backend == "openai":
        return OpenAIBackend(args.endpoint, args.model or args.target, sampling, args.concurrency, args.retries,
                             args.backoff, args.timeout, args.api_key)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    model = load_causal_lm(TargetConfig(path=args.target, dtype=dtype, device=str(device))).eval()
    return HFBackend(model, load_tokenizer(args.target), sampling, args.batch_size)


@refusals
def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    info = init_distributed()
    out = Path(args.output)
    sampling = SamplingSettings(args.temperature, args.top_p, args.max_new_tokens, args.seed)
    summary = Summary()
    try:
        sources = read_sources(args.data, args.format, args.skip_bad_rows, summary.skipped, args.rows_per_file)[: args.limit]
        if args.backend == "openai":
            who = {"model": args.model or args.target}
        else:  # the checkpoint itself: its resolved path and identity
            who = {**fingerprint(args.target), "name_or_path": str(Path(args.target).resolve())}
        plan = {"version": PLAN_VERSION, "data": [Path(f).name for f in args.data], "data_sha256": files_sha256(args.data),
                "format": args.format, "skip_bad_rows": args.skip_bad_rows, "limit": args.limit,
                "rows_per_file": args.rows_per_file, "rows_per_shard": args.rows_per_shard, "sampling": sampling.as_dict(),
                "backend": args.backend, "target": who,
                # sampled hf draws one random stream per batch, so the batch size is part of what was drawn
                "batch_size": args.batch_size if args.backend == "hf" and args.temperature > 0 else None}
        claim_output_dir(out, JOB_PLAN, "regeneration job", args.resume, args.overwrite, info)
        check_plan(out, plan, info.is_main)
    except (ValueError, OSError) as err:
        return report_error(err)
    barrier()
    missing = missing_shards(out, len(sources), args.rows_per_shard)
    barrier()  # every rank has listed the same missing shards before any writes one
    backend = backend_for(args, sampling, info.device)
    try:
        done = run_shards(out, sources, backend.generate, sampling, args.rows_per_shard, missing[info.rank::info.world_size],
                          progress=not args.no_progress and info.is_main)
    except ServerDown as err:
        report_error(f"{err}; finished shards are kept: run the same command with --resume once the server is back")
        return 1
    print(f"[rank {info.rank}] regenerated {done.rows:,} rows ({done.tokens:,} tokens) in {done.seconds:.0f} s",
          file=sys.stderr)
    for line in done.failed:
        print(f"[rank {info.rank}] failed: {line}", file=sys.stderr)
    barrier()
    if not info.is_main:
        return 0
    total = concatenate(out, len(sources), args.rows_per_shard)
    if total is None:
        print("error: rows failed for now (listed above); run the same command again with --resume to retry them", file=sys.stderr)
        return 1
    total.skipped = summary.skipped  # the whole output's summary; this run's rate (rank 0's share) below
    print(total.format())
    if done.seconds:
        print(f"this run, rank 0: {done.rows:,} rows, {done.tokens:,} tokens in {done.seconds:.0f} s "
              f"({done.rows / done.seconds:.2f} rows/s, {done.tokens / done.seconds:.1f} tokens/s)")
    print(f"wrote {total.rows:,} conversations to {out / 'regenerated.jsonl'}"
          + (f"; {len(total.failed):,} failed for good, listed in {out / 'failed.jsonl'}" if total.failed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(entry_point(main))
