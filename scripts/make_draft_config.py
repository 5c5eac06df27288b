"""Derive an EAGLE-3 draft config (server flat layout config.json) from a target's config.json.

    python scripts/make_draft_config.py --target /models/Llama-3.1-8B-Instruct --draft-vocab-size 32000 \
        --out configs/eagle3/llama3.1-8b.json

Only the target's config.json is read (no weights). Use the result as draft.config in a recipe.
"""

from __future__ import annotations

import argparse
import sys
import json
from pathlib import Path

from transformers import AutoConfig

from headstart.heads.eagle3.module import Eagle3Config
from headstart.scripts.command import entry_point, refusals


@refusals
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="directory (or config.json) of the target")
    p.add_argument("--draft-vocab-size", type=int, default=32000)
    p.add_argument("--aux-layer-ids", type=int, nargs="+", default=None, help="vLLM ids; default 2, L//2, L-3")
    p.add_argument("--eagle3.1", dest="eagle31", action="store_true",
                   help="EAGLE-3.1: fc_norm and norm_output on (docs/FORMATS.md A.1)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    path = Path(args.target)
    config = AutoConfig.from_pretrained(path.parent if path.name == "config.json" else path, local_files_only=True)
    draft = Eagle3Config.from_target(config, args.draft_vocab_size, tuple(args.aux_layer_ids) if args.aux_layer_ids else None,
                                     fc_norm=args.eagle31, norm_output=args.eagle31)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(draft.to_hf_dict(), indent=2) + "\n")
    print(f"wrote {args.out}: {draft.variant}, hidden {draft.hidden_size}, draft vocab {draft.draft_vocab_size}, aux layers {list(draft.aux_layer_ids)}")


if __name__ == "__main__":
    sys.exit(entry_point(main))
