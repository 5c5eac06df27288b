"""Convert a finished head into another of its layouts, losslessly (today: EAGLE-3, flat <-> speculators).

    python scripts/export_head.py --head runs/eagle3/final --to speculators --out heads/eagle3-speculators
    python scripts/export_head.py --head heads/eagle3-speculators --to flat --out heads/eagle3-flat

The flat layout is what SGLang loads (and vLLM with the eagle3 method in ``--speculative-config``);
the speculators layout is what ``vllm serve <head>`` detects by itself. Tensors keep their values and
dtype; only the decoder layer's prefix (``midlayer.`` / ``layers.0.``) and config.json change. The
speculators config names the target (``verifier``): by default the one the head records in
headstart.json; ``--target`` overrides it (the path vLLM will load the target from).
"""

from __future__ import annotations

import argparse
import sys

from headstart.heads.exports import convert_head
from headstart.models.errors import UserError
from headstart.models.provenance import fingerprint
from headstart.scripts.command import entry_point, refusals


@refusals
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", required=True, help="an exported head (any of its layouts)")
    p.add_argument("--to", required=True, help="the layout to write (EAGLE-3: flat | speculators)")
    p.add_argument("--out", required=True, help="directory for the converted head")
    p.add_argument("--target", default=None, help="the target's directory, named as the verifier in a speculators config")
    p.add_argument("--overwrite", "--force", dest="overwrite", action="store_true",
                   help="move what --out holds aside (to <out>.old-<time>) and write there; never the head's own "
                        "directory or one above it")
    args = p.parse_args(argv)
    try:
        out = convert_head(args.head, args.out, args.to, fingerprint(args.target) if args.target else None, args.overwrite)
    except ValueError as err:
        if "target's path" in str(err):  # the speculators config names its target: the flag that gives it
            raise UserError(f"{err} (--target)") from None
        raise
    print(f"wrote {out} ({args.to} layout)")
    return 0


if __name__ == "__main__":
    sys.exit(entry_point(main))
