"""Tokenize conversation files with a target's chat template and an assistant-only loss mask.

    python scripts/prepare_data.py --data chats.jsonl --tokenizer /models/Llama-3.1-8B-Instruct \
        --output data/tokenized --max-length 2048 --show 2

Writes a ``datasets`` directory (input_ids, loss_mask) plus summary.json, and prints a summary. An ``--output`` that
already holds files is refused unless ``--overwrite`` (which moves them aside to ``<output>.old-<time>``).
``--show N`` prints N examples with the trained tokens highlighted: check it before training.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from headstart.models.target import load_tokenizer
from headstart.models.errors import UserError
from headstart.models.files import check_out_dir, claim_dir
from headstart.trainer.data import DataConfig, build_dataset, split_rows
from headstart.trainer.render import highlight_trained
from headstart.scripts.command import check_at_least, entry_point, refusals


@refusals
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
    p.add_argument("--overwrite", action="store_true",
                   help="move what --output holds aside (to <output>.old-<time>) and write there")
    args = p.parse_args(argv)
    check_at_least(max_length=(args.max_length, 1), num_proc=(args.num_proc, 1), show=(args.show, 0))
    # Before the tokenizer loads or a row is read: a used --output, or one that is the data's own directory, is refused.
    check_out_dir(args.output, "--output", args.overwrite, [split_rows(f)[0] for f in args.data] + [args.tokenizer])
    if not Path(args.tokenizer).is_dir():
        raise UserError(f"--tokenizer {args.tokenizer}: " + ("a file, not a directory" if Path(args.tokenizer).exists()
                        else "no such directory") + "; give the target's (or its tokenizer's) local directory")
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
    dataset, summary = build_dataset(config, tokenizer)
    out = Path(args.output)
    claim_dir(out, "--output", args.overwrite, [split_rows(f)[0] for f in args.data] + [args.tokenizer])
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
    sys.exit(entry_point(main))
