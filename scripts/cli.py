"""The ``headstart`` command: one entry point for the user commands in scripts/.

    headstart train --config configs/demo/eagle3.yaml          # one process
    torchrun --nproc_per_node 8 -m headstart.train --config ... # several (or: torchrun scripts/train_eagle3.py)
    headstart bench --help

Each subcommand is the script of the same job with the same flags; ``python scripts/NAME.py`` runs it too.
"""

from __future__ import annotations

import importlib
import re
import sys

COMMANDS: dict[str, str] = {
    "prepare": "prepare_data",
    "regenerate": "regenerate_data",
    "features": "generate_features",
    "train": "train_eagle3",
    "export": "export_head",
    "publish": "publish_head",
    "check": "check_head",
    "bench": "benchmark",
    "generate": "generate",
    "evaluate": "evaluate_head",
    "medusa-tree": "medusa_tree",
    "draft-config": "make_draft_config",
    "import-gguf": "import_gguf",
}
"""Subcommand -> module of headstart.scripts (whose ``main`` it runs)."""


SENTENCE_END = r"(?<!e\.g)[.:]\s+(?=[A-Za-z])"


def usage() -> str:
    lines = ["usage: headstart COMMAND [--help | ARGS...]", "", "commands:"]
    for name, module in COMMANDS.items():
        doc = (importlib.import_module(f"headstart.scripts.{module}").__doc__ or "").strip()
        first = " ".join(doc.split("\n\n")[0].split())  # the docstring's first paragraph, its first sentence
        summary = re.split(SENTENCE_END, first)[0].rstrip(".:")
        lines.append(f"  {name:<13} {summary}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"headstart: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"headstart.scripts.{COMMANDS[name]}")
    sys.argv = [f"headstart {name}", *rest]  # every script parses sys.argv (some take no argv parameter)
    code = module.main()
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
