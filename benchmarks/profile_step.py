"""Where a training step's time goes: torch.profiler over a few steps of a recipe, split by the scopes the trainer
and the heads name (data, features = the target's forward or the store's read, the head's forward -- its draft
steps and its vocab loss --, its backward, the optimizer) and, below, the ops that cost most.

    python benchmarks/profile_step.py --config configs/demo/eagle3.yaml --steps 3 --out runs/profile.md

One process (the profile of one rank). The scopes nest: "head: draft step" and "head: vocab loss" are parts of
"step: head forward" (the loss's chunks recomputed in backward are counted in "step: head backward").

The scopes are host wall time, also on a GPU: a GPU's annotation ranges span idle gaps, and the backward's kernels
are launched from autograd's device thread, outside the scope that waits for them. On a GPU the op table is the
kernels' device time, and their sum over the step says how busy the GPU was.

Then ``--flop-steps`` more steps and the target's own forward on each step's batch are counted in FLOPs
(``FlopCounterMode``: matrix products; attention's own products are not counted on a CPU, where its kernel has no
FLOP formula): their ratio is what the step would cost relative to the target's forward if every product ran at the
same speed -- the floor under the measured "step / target forward" of benchmarks/bench_train.py. It depends on the
batch (the share of its tokens that are trained: later TTT steps run only there), so it is summed over several.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

from headstart.benchmarks.bench_train import next_batches, target_forward
from headstart.trainer.config import load_config
from headstart.trainer.run import build_trainer
from headstart.benchmarks.record import write_table

SCOPES = ("step: data", "step: features", "target: aux states", "step: head forward", "head: draft step",
          "head: vocab loss", "step: head backward", "step: optimizer")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=3, help="profiled steps (after one warm-up step)")
    p.add_argument("--top", type=int, default=12, help="ops listed by their own time")
    p.add_argument("--flop-steps", type=int, default=10, help="steps whose FLOPs are counted (after the profiled ones)")
    p.add_argument("--out", default=None, help="write the tables to this markdown file")
    args, overrides = p.parse_known_args()
    # Features prefetched on a worker thread would hide from the scopes and from FlopCounterMode (thread-local).
    config = load_config(args.config, overrides + ["--output_dir=runs/profile-step", "--logging.progress=false",
                                                   "--train.prefetch=false"])
    trainer = build_trainer(config)
    trainer.train_step()  # warm-up
    trainer.step += 1
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            trainer.train_step()
            trainer.step += 1
    step_flops, forward_flops = [], []
    offline = config.features.path is not None  # no target in the process: nothing to compare the FLOPs with
    for _ in range(0 if offline else args.flop_steps):
        batches = next_batches(trainer)
        with FlopCounterMode(display=False) as forward:
            target_forward(trainer, batches)
        with FlopCounterMode(display=False) as step:
            trainer.train_step()
        trainer.step += 1
        step_flops.append(step.get_total_flops())
        forward_flops.append(max(1, forward.get_total_flops()))
    ratios = [s / f for s, f in zip(step_flops, forward_flops)]
    device_time = torch.cuda.is_available()
    events = prof.key_averages()
    by_name = {e.key: e for e in events}

    def ms(e) -> float:  # per step, host wall time
        return e.cpu_time_total / 1e3 / args.steps

    step_ms = sum(ms(by_name[s]) for s in ("step: data", "step: features", "step: head forward",
                                          "step: head backward", "step: optimizer") if s in by_name)
    lines = ["| part of the step | ms per step | share |", "|---|---|---|"]
    for scope in SCOPES:
        if scope in by_name:
            nested = not scope.startswith("step: ")
            name = f"&nbsp;&nbsp;{scope} (within the above)" if nested else scope
            lines.append(f"| {name} | {ms(by_name[scope]):.1f} | {ms(by_name[scope]) / step_ms:.0%} |")
    lines.append(f"| **the scopes together** | {step_ms:.1f} | 100% |")
    ops = sorted((e for e in events if not e.key.startswith(("step: ", "head: ", "target: ", "ProfilerStep"))),
                 key=lambda e: -(e.self_device_time_total if device_time else e.self_cpu_time_total))[: args.top]
    own = lambda e: (e.self_device_time_total if device_time else e.self_cpu_time_total) / 1e3 / args.steps  # noqa: E731
    op_lines = ["| op (own time) | ms per step | calls per step |", "|---|---|---|"]
    op_lines += [f"| `{e.key}` | {own(e):.1f} | {e.count / args.steps:.0f} |" for e in ops]
    if device_time:  # the kernels' time (aten ops would count it twice), against the step's host wall time
        busy = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3 / args.steps
        op_lines.append(f"\nKernel time on the GPU: {busy:.1f} ms per step, against {step_ms:.1f} ms of host wall time "
                        f"({busy / step_ms:.0%} busy).")
    t, d = config.train, config.data
    options = ", ".join(f"{f.name} {getattr(config.draft.options, f.name)}" for f in dataclasses.fields(config.draft.options))
    body = (f"{'Offline' if config.features.path else 'Online'} {config.draft.head} training ({options}), batch "
            f"{t.batch_size} x {t.grad_accum} accum, one process, max length {d.max_length}, "
            f"{'packed' if d.packing else 'padded'} batches, target dtype {config.target.dtype}; {args.steps} steps "
            f"profiled after one warm-up, host wall time per step (ops: {'device' if device_time else 'host'} time).\n\n"
            + "\n".join(lines) + "\n\n" + "\n".join(op_lines) + "\n\n"
            + ("" if not ratios else  # an offline run has no target forward to compare with
               f"FLOPs of {args.flop_steps} steps / FLOPs of the target's own forward on their batches (matrix products): "
               f"{sum(step_flops) / 1e9:,.3f} / {sum(forward_flops) / 1e9:,.3f} GFLOP = **{sum(step_flops) / sum(forward_flops):.2f}x** "
               f"(a step's own: median {statistics.median(ratios):.2f}x, {min(ratios):.2f}x-{max(ratios):.2f}x)\n"))
    print(body)
    if args.out:
        write_table(args.out, f"Where a training step goes: {config.draft.head}", body)


if __name__ == "__main__":
    main()
