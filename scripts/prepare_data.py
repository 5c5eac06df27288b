"""Tokenize conversation files with a target's chat template and an assistant-only loss mask.

    python scripts/prepare_data.py --data chats.jsonl --tokenizer /models/Llama-3.1-8B-Instruct \
        --output data/tokenized --max-length 2048 --show 2

Writes a ``datasets`` directory (input_ids, loss_mask) plus summary.json, and prints a summary.
``--show N`` prints N examples with the trained tokens highlighted: check it before training.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from headstart.models.target import load_tokenizer
from headstart.trainer.data import DataConfig, build_dataset
from headstart.trainer.render import highlight_trained


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", nargs="+", required=True, help=".json/.jsonl/.parquet conversation files")
    p.add_argument("--tokenizer", required=True, help="local tokenizer (or model) directory")
    p.add_argument("--output", required=True, help="directory for the tokenized dataset")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--format", choices=["sharegpt", "messages", "instruction", "gsm8k", "text"], default=None,
                   help="row format of every file (default: detected per file)")
    p.add_argument("--last-turn-only", action="store_true", help="train only on each conversation's last assistant turn")
    p.add_argument("--skip-bad-rows", action="store_true", help="skip and count malformed rows instead of stopping")
    p.add_argument("--text-markers", nargs=2, metavar=("START", "END"), default=None,
                   help="for 'text' rows: train only between these markers")
    p.add_argument("--num-proc", type=int, default=1, help="tokenization processes")
    p.add_argument("--cache-dir", default=None, help="tokenization cache (default $HEADSTART_CACHE or ~/.cache/headstart)")
    p.add_argument("--show", type=int, default=0, metavar="N", help="print N examples with trained tokens highlighted")
    p.add_argument("--trust-remote-code", action="store_true")
    args = p.parse_args(argv)

    tokenizer = load_tokenizer(args.tokenizer, args.trust_remote_code)
    config = DataConfig(
        files=tuple(args.data),
        format=args.format,
        max_length=args.max_length,
        last_turn_only=args.last_turn_only,
        skip_bad_rows=args.skip_bad_rows,
        text_markers=tuple(args.text_markers) if args.text_markers else None,
        num_proc=args.num_proc,
        cache_dir=args.cache_dir,
    )
    try:
        dataset, summary = build_dataset(config, tokenizer)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = Path(args.output)
    dataset.save_to_disk(str(out))
    (out / "summary.json").write_text(json.dumps({**asdict(summary), "config": asdict(config), "tokenizer": args.tokenizer}, indent=2))
    print(summary.format())
    print(f"wrote {len(dataset):,} sequences to {out}")
    color = sys.stdout.isatty()
    for i in range(min(args.show, len(dataset))):
        row = dataset[i]
        print(f"\n--- example {i} ({sum(row['loss_mask'])} of {len(row['input_ids'])} tokens trained"
              + (", shown in green" if color else ", shown inside [[ ]]") + ") ---")
        print(highlight_trained(tokenizer, row["input_ids"], row["loss_mask"], color=color))
    return 0


if __name__ == "__main__":
    sys.exit(main())
