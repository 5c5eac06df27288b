"""Measure online training throughput: tokens/s and the cost of a training step relative to the
target's forward alone on the same batch.

    python benchmarks/bench_train.py --config configs/demo/eagle3.yaml --steps 10 --out BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from headstart.decode.report import append_section
from headstart.trainer.batches import collate
from headstart.trainer.config import load_config
from headstart.trainer.run import build_trainer


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=10, help="measured steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None, help="append the result to this markdown file")
    args, overrides = p.parse_known_args()
    config = load_config(args.config, overrides + ["--output_dir=runs/bench-train", "--logging.progress=false"])
    trainer = build_trainer(config)
    target = trainer.features.target
    step_s, target_s, tokens = [], [], []
    for i in range(args.warmup + args.steps):
        accum = config.train.grad_accum
        batches = [collate(trainer.train_data, trainer.plan.rows(trainer.step, m)) for m in range(accum)]
        _sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            for b in batches:
                target(b["input_ids"].to(trainer.info.device), attention_mask=b["attention_mask"].to(trainer.info.device))
        _sync()
        t1 = time.perf_counter()
        metrics = trainer.train_step()
        _sync()
        t2 = time.perf_counter()
        trainer.step += 1
        if i >= args.warmup:
            target_s.append(t1 - t0)
            step_s.append(t2 - t1)
            tokens.append(metrics["tokens"])
    step, fwd = statistics.median(step_s), statistics.median(target_s)
    tok_s = sum(tokens) / sum(step_s)
    t = config.train
    body = (
        f"Online EAGLE-3 training, {config.draft.options.ttt_steps} TTT steps, draft vocab {config.draft.options.draft_vocab_size}, "
        f"batch {t.batch_size} x {t.grad_accum} accum x {trainer.info.world_size} ranks, "
        f"max length {config.data.max_length}, target dtype {config.target.dtype}, backend {config.parallel.backend}; "
        f"median of {args.steps} steps after {args.warmup} warm-up.\n\n"
        "| tokens/s (all ranks) | step time | target forward alone | step / target forward |\n|---|---|---|---|\n"
        f"| {tok_s:,.0f} | {step * 1e3:.0f} ms | {fwd * 1e3:.0f} ms | {step / fwd:.1f}x |\n"
    )
    print(body)
    if args.out and trainer.info.is_main:
        append_section(args.out, "Online training throughput", body)


if __name__ == "__main__":
    main()
