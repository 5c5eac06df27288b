"""What a target forward over a block of n tokens costs, n = 1..max: the verify cost a draft of n - 1 tokens pays.

    python benchmarks/block_costs.py --target targets/SmolLM2-135M-Instruct --dtypes float32 bfloat16 --max-block 9 \
        --table runs/blocks.md

Each dtype's eager runner (decode/target_runner.py ``time_blocks``: median of --repeats forwards after a --context
token prompt, nothing committed) and the sizes ``tune_blocks`` (``--tune-blocks`` in scripts/benchmark.py) would pad
each block to from these costs (``pad_sizes``). On a memory-bound machine the cost barely grows with n; where it does not grow monotonically
(a BLAS multiplying a few rows as separate matrix-vector products) a shorter draft costs more to verify than a longer one.
"""

from __future__ import annotations

import argparse

from headstart.decode.target_runner import TargetRunner, pad_sizes
from headstart.models.target import Target, TargetConfig
from headstart.benchmarks.record import write_table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--dtypes", nargs="+", default=["float32"])
    p.add_argument("--max-block", type=int, default=9)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--device", default="cpu")
    p.add_argument("--table", default=None, help="write the table to this markdown file")
    p.add_argument("--note", default="")
    args = p.parse_args()

    sizes = range(1, args.max_block + 1)
    lines = ["| dtype | " + " | ".join(f"n={n}" for n in sizes) + " | padded to (tune_blocks) |",
             "|---|" + "---|" * len(sizes) + "---|"]
    for dtype in args.dtypes:
        target = Target.from_pretrained(TargetConfig(path=args.target, dtype=dtype, device=args.device))
        runner = TargetRunner(target, max_len=args.context + args.max_block, with_aux=True)
        cost = runner.time_blocks(args.max_block, args.context, args.repeats)
        pads = pad_sizes(cost)
        cells = " | ".join(f"{cost[n] * 1e3:.1f} ms ({cost[n] / cost[1]:.2f}x)" for n in sizes)
        padded = ", ".join(f"{n}->{m}" for n, m in pads.items() if m != n) or "none"
        lines.append(f"| {dtype} | {cells} | {padded} |")
        print(lines[-1], flush=True)
        del runner, target
    body = (f"Target `{args.target}`, eager `TargetRunner` with aux states (EAGLE-3's verify), one forward over a causal "
            f"block of n tokens after a {args.context}-token prompt, median of {args.repeats} (x the 1-token cost):\n\n"
            + "\n".join(lines) + "\n")
    if args.note:
        body += "\n" + args.note + "\n"
    print(body)
    if args.table:
        write_table(args.table, f"Target forward by block size ({args.target.rstrip('/').split('/')[-1]})", body)


if __name__ == "__main__":
    main()
