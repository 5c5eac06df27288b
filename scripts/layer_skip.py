"""Search the layers Draft & Verify's drafts skip (decode/layer_skip.py): a greedy search on conversations the target
answered -- each layer scored skipped alone, then from none skipped each step skips the one more layer (among the
--candidates missed least alone) that keeps the skipping model's next-token choice closest to the full target's -- and
write the set with what the search cost.

    headstart layer-skip --config configs/smollm2/eagle3.yaml --data 'configs/smollm2/data/regenerated.jsonl[0:4]' \
        --skip 12 --output runs/smollm2-layer-skip.json
    headstart bench --target targets/SmolLM2-135M-Instruct --method layer-skip --skip-layers "$(jq -r .skip_arg \
        runs/smollm2-layer-skip.json)" ...

Search on other conversations than the ones you report on: the recipe's own training replies serve (no head trains).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from headstart.decode.layer_skip import layer_skip_search
from headstart.models.target import Target, TargetConfig, load_causal_lm, load_tokenizer
from headstart.scripts.command import check_at_least, entry_point, refusals
from headstart.trainer.config import load_config
from headstart.trainer.ngram_corpus import tokenized_conversations


def ranges(layers: list[int]) -> str:
    """[3, 4, 5, 9] -> "3-5,9" (what ``--skip-layers`` reads)."""
    out, start = [], None
    for i, layer in enumerate(layers):
        start = layer if start is None else start
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            out.append(str(start) if start == layer else f"{start}-{layer}")
            start = None
    return ",".join(out)


@refusals
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="a training recipe: its target (and data.files, without --data)")
    p.add_argument("--data", nargs="+", default=None, metavar="FILE",
                   help="conversation files (file[a:b] for rows a..b) to search on; default: the recipe's data.files")
    p.add_argument("--conversations", type=int, default=4, help="how many of them (the first)")
    p.add_argument("--max-tokens", type=int, default=256, help="each conversation cut to this many tokens")
    p.add_argument("--candidates", type=int, default=8,
                   help="layers tried at each step of the search: the ones missed least when skipped alone")
    p.add_argument("--skip", type=int, required=True, help="how many of the target's layers to skip")
    p.add_argument("--output", required=True, help="the JSON file the set and the search's cost go to")
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)
    check_at_least(conversations=(args.conversations, 1), max_tokens=(args.max_tokens, 2), skip=(args.skip, 1),
                   candidates=(args.candidates, 1))
    if Path(args.output).exists() and not args.overwrite:
        p.error(f"--output {args.output} exists; pass --overwrite to replace it")
    config = load_config(args.config, [])
    files = args.data or config.data.files
    if not files:
        p.error(f"{args.config}: the recipe names no data.files; give --data")
    tokenizer = load_tokenizer(config.target.path)
    sequences = []
    for tok in tokenized_conversations(files, tokenizer, "the layer-skip search"):
        sequences.append(torch.tensor([list(tok.input_ids)[: args.max_tokens]]))
        if len(sequences) == args.conversations:
            break
    target = Target(load_causal_lm(TargetConfig(path=config.target.path, dtype="float32", device="cpu")),
                    capture_aux=False)
    if not 0 < args.skip < target.num_layers:
        p.error(f"--skip {args.skip}: the target has {target.num_layers} layers; skip 1..{target.num_layers - 1}")
    found = layer_skip_search(target, sequences, args.skip, args.candidates, progress=lambda line: print(line, flush=True))
    found = {"target": config.target.path, "data": files, "conversations": len(sequences), **found,
             "skip_arg": ranges(found["skip_layers"])}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(found, indent=1) + "\n")
    print(f"wrote {args.output}: skip {found['skip_arg']} ({args.skip} of {found['num_layers']} layers), greedy agreement "
          f"{found['agreement']:.3f}; {found['forwards']} forwards over {found['tokens']:,} tokens in {found['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(entry_point(main))
