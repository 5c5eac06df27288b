"""Measure online training throughput: trained tokens/s and the cost of a training step relative to the
target's forward alone on the same batch; with ``--layouts padded packed``, both batch layouts of the same
recipe one after the other in this process, on the same steps' sequences (a ratio from one run).

    python benchmarks/bench_train.py --config configs/demo/eagle3.yaml --steps 10 --layouts padded packed --out runs/bench-train.md

Tokens are the sequences' real tokens (padding not counted), so padded and packed rows compare directly.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time

import torch

from headstart.trainer.config import load_config
from headstart.trainer.run import build_trainer
from headstart.benchmarks.record import write_table


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def next_batches(trainer) -> list[dict[str, torch.Tensor]]:
    """The micro-batches the trainer's next ``train_step`` will train on."""
    return [trainer.batch(trainer.train_data, trainer.plan.rows(trainer.step, m)) for m in range(trainer.config.train.grad_accum)]


@torch.no_grad()
def target_forward(trainer, batches: list[dict[str, torch.Tensor]]) -> None:
    """The target's own forward (HF, logits included) over ``batches``, as trainer/features.py runs it: a packed
    batch by its positions."""
    device = trainer.info.device
    for b in batches:
        pos = b.get("position_ids")
        trainer.features.target(b["input_ids"].to(device), attention_mask=b["attention_mask"].to(device) if pos is None else None,
                                position_ids=None if pos is None else pos.to(device))


def measure(config, steps: int, warmup: int, deal: str = "cost") -> dict:
    """Median step and target-forward seconds over ``steps`` steps after ``warmup``, trained tokens/s, and how
    many of the batches' slots were padding. ``deal="stream"``: each rank's micro-batch is B consecutive rows of
    the step's stream, as before rows were dealt by cost (the same rows per step, split otherwise)."""
    trainer = build_trainer(config)
    if deal == "stream":
        trainer.plan.work = None
    step_s, target_s, tokens, slots = [], [], [], []
    for i in range(warmup + steps):
        batches = next_batches(trainer)
        # Untimed first: a batch's new shapes can cost their first call more (on an H200 the same forward measured
        # 77-87 ms in the first trainer of a process and 30-33 ms in the second; the caching allocator's new blocks
        # are a likely cause, not tested), which is not the forward's cost -- and the step's own forward comes second.
        target_forward(trainer, batches)
        _sync()
        t0 = time.perf_counter()
        target_forward(trainer, batches)
        _sync()
        t1 = time.perf_counter()
        metrics = trainer.train_step()
        _sync()
        t2 = time.perf_counter()
        trainer.step += 1
        if i >= warmup:
            target_s.append(t1 - t0)
            step_s.append(t2 - t1)
            tokens.append(metrics["tokens"])
            slots.append(sum(b["input_ids"].numel() for b in batches) / sum(float(b["attention_mask"].sum()) for b in batches))
    info = trainer.info
    del trainer
    gc.collect()
    return {"step": statistics.median(step_s), "fwd": statistics.median(target_s), "tok_s": sum(tokens) / sum(step_s),
            "slots_per_token": statistics.mean(slots), "info": info}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=10, help="measured steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layouts", nargs="+", choices=["recipe", "padded", "packed"], default=["recipe"],
                   help="batch layouts to measure in turn (recipe: whatever data.packing says)")
    p.add_argument("--deal", nargs="+", choices=["cost", "stream"], default=["cost"],
                   help="how a packed step's rows go to ranks and micro-batches, measured in turn: by cost (the "
                        "trainer's way) or B consecutive rows each (before); padded batches always take consecutive rows")
    p.add_argument("--compile", nargs="+", choices=["recipe", "off", "on"], default=["recipe"],
                   help="train.compile settings to measure in turn (the head's parts through torch.compile)")
    p.add_argument("--out", default=None, help="write the result to this markdown file")
    args, overrides = p.parse_known_args()
    config = load_config(args.config, overrides + ["--output_dir=runs/bench-train", "--logging.progress=false"])
    rows = {}
    for compiled in args.compile:
        train = config.train if compiled == "recipe" else dataclasses.replace(config.train, compile=compiled == "on")
        for layout in args.layouts:
            data = config.data if layout == "recipe" else dataclasses.replace(config.data, packing=layout == "packed")
            for deal in args.deal if data.packing else ["stream"]:  # padded batches are never dealt (trainer/loop.py)
                torch._dynamo.reset()  # each run's head compiles afresh (its compile time is in the warm-up)
                rows["packed" if data.packing else "padded", deal, train.compile] = measure(
                    dataclasses.replace(config, data=data, train=train), args.steps, args.warmup, deal)
    info = next(iter(rows.values()))["info"]
    t, d = config.train, config.data
    options = ", ".join(f"{f.name} {getattr(config.draft.options, f.name)}" for f in dataclasses.fields(config.draft.options))
    body = (
        f"Online {config.draft.head} training ({options}), batch {t.batch_size} sequences x {t.grad_accum} accum x "
        f"{info.world_size} ranks, max length {d.max_length}, packed rows of at most {d.tokens_per_batch or t.batch_size * d.max_length} tokens, "
        f"target dtype {config.target.dtype}, backend {config.parallel.backend}, features prefetched "
        f"{'on a worker thread' if t.prefetch else 'no'}; median of {args.steps} steps after "
        f"{args.warmup} warm-up, each layout on the same steps' sequences. tokens = the sequences' real tokens; "
        "slots / token = batch positions (padding included) per real token; rows dealt = how a step's rows go to "
        "ranks and micro-batches (by cost: level work, packed only, trainer/batches.py; stream: B consecutive rows each).\n\n"
        "head parts compiled = train.compile (models/train_compile.py; the target's forward stays eager in both).\n\n"
        "| tokens/s (all ranks) | layout | rows dealt | head parts compiled | step time | target forward alone | "
        "step / target forward | slots / token |\n"
        "|---|---|---|---|---|---|---|---|\n"
        + "".join(f"| {r['tok_s']:,.0f} | {layout} | {'by cost' if deal == 'cost' else 'stream'} | {'yes' if c else 'no'} | "
                  f"{r['step'] * 1e3:.0f} ms | {r['fwd'] * 1e3:.0f} ms | {r['step'] / r['fwd']:.1f}x | {r['slots_per_token']:.2f} |\n"
                  for (layout, deal, c), r in rows.items())
    )
    for c in sorted({c for *_, c in rows}):
        for deal in args.deal:
            if ("padded", "stream", c) in rows and ("packed", deal, c) in rows:
                body += (f"\npacked ({'by cost' if deal == 'cost' else 'stream'}) / padded tokens/s"
                         f"{', compiled' if c else ''}: **{rows['packed', deal, c]['tok_s'] / rows['padded', 'stream', c]['tok_s']:.2f}x**\n")
        if ("packed", "cost", c) in rows and ("packed", "stream", c) in rows:
            body += (f"\npacked, by cost / stream tokens/s{', compiled' if c else ''}: "
                     f"**{rows['packed', 'cost', c]['tok_s'] / rows['packed', 'stream', c]['tok_s']:.2f}x**\n")
    for (layout, deal, c), r in rows.items():
        if c and (layout, deal, False) in rows:
            body += (f"\n{layout} ({'by cost' if deal == 'cost' else 'stream'}), compiled / eager tokens/s: "
                     f"**{r['tok_s'] / rows[layout, deal, False]['tok_s']:.2f}x**\n")
    print(body)
    if args.out and info.is_main:
        write_table(args.out, "Online training throughput", body)


if __name__ == "__main__":
    main()
