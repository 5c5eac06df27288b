"""Offline training start-up: time to the first step from feature stores with different shard counts.

    python benchmarks/bench_features.py --config configs/demo/eagle3.yaml \
        --stores runs/feat-a runs/feat-b --out runs/lab-notes.md [overrides]

For each store (same data, different ``features.samples_per_shard``): build the trainer (reads the
manifest; shards are opened lazily) and run one optimizer step. Also prints bytes per token.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from headstart.decode.report import append_section
from headstart.trainer.config import load_config
from headstart.trainer.run import build_trainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--stores", nargs="+", required=True)
    p.add_argument("--out", default=None, help="append the result to this markdown file")
    args, overrides = p.parse_known_args()
    lines = ["| store | shards | samples | bytes/token | build trainer (s) | first step (s) | time to first step (s) |",
             "|---|---|---|---|---|---|---|"]
    for store in args.stores:
        manifest = json.loads((Path(store) / "manifest.json").read_text())
        config = load_config(args.config, [*overrides, f"--features.path={store}", "--output_dir=runs/bench-features",
                                           "--logging.progress=false"])
        t0 = time.perf_counter()
        trainer = build_trainer(config)
        t1 = time.perf_counter()
        trainer.train_step()
        t2 = time.perf_counter()
        per_token = manifest["bytes"] / manifest["num_tokens"]
        line = (f"| `{store}` | {len(manifest['shards'])} | {manifest['num_samples']:,} | {per_token:,.0f} | {t1 - t0:.2f} | "
                f"{t2 - t1:.2f} | {t2 - t0:.2f} |")
        print(line)
        lines.append(line)
    if args.out:
        append_section(args.out, "Offline training: time to the first step vs number of shards",
                       "One process, warm page cache and tokenized-data cache. The manifest is read at start; each "
                       "shard is opened (and its crc32 checked) when a batch first needs it.\n\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
