"""Build REST's datastore from a recipe's conversations: a suffix array over their token ids (decode/rest.py).

    headstart datastore --config configs/demo/eagle3_regenerated.yaml --output runs/demo-datastore
    headstart bench --target configs/demo/target --method rest --datastore runs/demo-datastore ...

Every conversation of the recipe's ``data.files`` (the target's own replies make the best datastore: what it says
is what it will be asked to verify) is rendered with the target's chat template, as the trainer renders it. Writes
tokens.npy, suffix_array.npy and datastore.json (the sources, the tokenizer's fingerprint, the size and how long the
build took), and prints the build time and size.
"""

from __future__ import annotations

import argparse
import sys

from headstart.models.files import check_out_dir, claim_dir
from headstart.models.target import load_tokenizer
from headstart.scripts.command import entry_point, refusals
from headstart.trainer.config import load_config
from headstart.trainer.ngram_corpus import datastore_from_conversations


@refusals
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="a training recipe: its target's tokenizer and its data.files")
    p.add_argument("--output", required=True, help="the datastore's directory")
    p.add_argument("--overwrite", action="store_true", help="move what --output holds aside and write there")
    args, overrides = p.parse_known_args(argv)  # the rest: recipe overrides, e.g. --data.files=[...] (as train's)
    config = load_config(args.config, overrides)
    if not config.data.files:
        p.error(f"{args.config}: the recipe names no data.files to build a datastore from")
    if not config.target.path:
        p.error(f"{args.config}: the recipe names no target.path (its tokenizer renders the conversations)")
    check_out_dir(args.output, "--output", args.overwrite, config.data.files)
    store = datastore_from_conversations(config.data.files, load_tokenizer(config.target.path))
    claim_dir(args.output, "--output", args.overwrite, config.data.files)
    store.meta["target"] = config.target.path
    store.save(args.output)
    meta = store.meta
    print(f"wrote {args.output}: {meta['sequences']:,} conversations, {meta['tokens']:,} tokens, "
          f"{meta['bytes'] / 2**20:.1f} MiB, built in {meta['build_seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(entry_point(main))
