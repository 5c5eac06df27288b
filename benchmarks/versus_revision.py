"""A head's drafter against the same head's drafter at another git revision, paired in one process.

``headstart bench --versus`` compares two drafting methods turn by turn on one machine (the two take turns at going
first), which is what a drafter change needs: this CPU drifts by tens of percent between runs minutes apart. This
script loads ``heads/<head>/drafter.py`` as it was at ``--rev`` (its imports resolve against today's package: a drafter
whose dependencies changed since cannot be loaded, and the error says which import), adds it to the drafting-method
catalog as ``<head>@<rev>``, and runs ``headstart bench`` with the remaining flags and ``--versus '--method
<head>@<rev>'`` with today's ``--draft``, chain length, tree and ``--compile``. results.json's ``paired`` holds the tokens/s ratio of
today's drafter to the revision's, over all turns and turn by turn.

    python benchmarks/versus_revision.py --rev 507313e -- --target configs/demo/target --draft configs/demo/eagle3-head \\
        --method eagle3 --questions configs/demo/eval/mt_bench.jsonl --per-category 1 --max-new-tokens 128 --num-speculative-tokens 4 \\
        --out runs/versus-drafter
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from headstart.decode import methods as decode_methods
from headstart.heads.methods import head_method
from headstart.heads.registry import head_spec
from headstart.scripts import benchmark

REPO = Path(__file__).resolve().parents[1]


def drafter_class_at(rev: str, head: str) -> type:
    """The drafter class of ``heads/<head>/drafter.py`` at git revision ``rev`` (the spec's class name)."""
    path = f"heads/{head}/drafter.py"
    try:
        source = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO, check=True, capture_output=True, text=True).stdout
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"git show {rev}:{path} failed: {e.stderr.strip()}") from e
    name = head_spec(head).drafter.__name__
    file = Path(tempfile.mkdtemp()) / f"{head}_drafter_at_{rev}.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[file.stem] = module  # torch.compile's tracing looks the module up by name
    spec.loader.exec_module(module)
    if not hasattr(module, name):
        raise SystemExit(f"{path} at {rev} has no class {name}")
    return getattr(module, name)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rev", required=True, help="the git revision whose drafter is the baseline")
    p.add_argument("bench", nargs=argparse.REMAINDER, help="-- then headstart bench's flags for today's drafter")
    args = p.parse_args(argv)
    flags = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    first = benchmark.build_parser().parse_args(flags)
    name = f"{first.method}@{args.rev}"
    spec = head_spec(first.method)
    cls = drafter_class_at(args.rev, first.method)
    # the head's own method, built as headstart bench builds it, with the revision's drafter class
    decode_methods.METHODS[name] = head_method(first.method, dataclasses.replace(
        spec, title=f"{spec.title} drafted by {cls.__name__} at {args.rev}", drafter=cls))
    # the revision's drafter in the same shape as today's: chain length, tree, compilation
    rival = ["--method", name, "--draft", first.draft, "--num-speculative-tokens", str(first.num_speculative_tokens)]
    if first.tree:
        rival += ["--tree", "--tree-depth", str(first.tree_depth), "--tree-topk", str(first.tree_topk),
                  "--tree-total-tokens", str(first.tree_total_tokens)]
    rival += ["--compile"] if first.compile else []
    benchmark.main(flags + ["--versus", shlex.join(rival)])


if __name__ == "__main__":
    main(sys.argv[1:])
