"""Count the eager ops a compiled drafter dispatches per round outside its compiled graphs: on a GPU each is a kernel
launch (tens of microseconds on an H200), which at a small model's size is
what a round costs. Counted with torch.profiler, so it runs anywhere; the counts do not depend on the machine.

    python benchmarks/drafter_launches.py --target configs/demo/target --k 4 --out runs/launches.md

Heads: the demo's EAGLE-3, MTP and Medusa heads (``--heads kind=DIR ...`` for others).
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from headstart.decode.target_runner import TargetRunner
from headstart.decode.tree import DynamicTree, build_dynamic_tree
from headstart.heads.registry import drafter_for, load_head
from headstart.models.target import Target, TargetConfig
from headstart.benchmarks.record import write_table

COMPILED_SCOPE = "Torch-Compiled Region"
"""The profiler scope of a compiled graph's call (any backend): the ops under it are the graph's, not eager launches."""

NO_KERNEL = frozenset(f"aten::{name}" for name in (
    "view", "_unsafe_view", "reshape", "_reshape_alias", "slice", "select", "unsqueeze", "squeeze", "expand", "as_strided",
    "transpose", "permute", "t", "alias", "detach", "detach_", "lift_fresh", "empty", "empty_strided"))
"""Ops that only make a view or take memory: no kernel launched, so not counted."""


def eager_ops(fn: Callable[[], object]) -> int:
    """Top-level aten ops ``fn`` dispatches outside compiled graphs (ops an op calls internally not counted again), views
    and allocations (``NO_KERNEL``) left out: about the kernels it launches on a GPU."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    count = 0
    for event in prof.events():
        if not event.name.startswith("aten::") or event.name in NO_KERNEL:
            continue
        parents, parent = [], event.cpu_parent
        while parent is not None:
            parents.append(parent.name)
            parent = parent.cpu_parent
        if parents and parents[0].startswith("aten::"):
            continue  # inside another op
        if not any(name.startswith(COMPILED_SCOPE) for name in parents):
            count += 1
    return count


@torch.no_grad()
def round_ops(target: Target, head: torch.nn.Module, k: int, backend: str = "inductor", max_len: int = 256) -> dict[str, int]:
    """Eager ops of a compiled drafter's ``propose(k)`` and of its ``update`` reading back 3 tokens (2 accepted and a
    bonus), each measured on its second round (the first compiles). ``backend``: dynamo's ("eager" traces the same
    graphs in seconds, for tests)."""
    # the default backend left to the registry, so the script also counts older checkouts' drafters (before/after)
    drafter = drafter_for(head, max_len, compile=True, **({} if backend == "inductor" else {"backend": backend}))
    drafter.precompile(k + 1)
    runner = TargetRunner(target, max_len)
    prompt = torch.randint(3, min(1000, target.vocab_size), (1, 40), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(runner.device)
    logits, states = runner.forward(prompt)
    runner.commit(prompt.shape[1])
    drafter.begin(prompt, states, int(logits[0, -1].argmax()))
    counts = {}
    for measured in (False, True):
        drafts = drafter.propose(k)
        if measured:
            counts["propose"] = eager_ops(lambda: drafter.propose(k))
        _, states = runner.forward(torch.cat([drafts.new_tensor([5]), drafts]).view(1, -1).to(runner.device))
        runner.commit(3)
        kept = type(states)(**{f: None if v is None else v[:, :3] for f, v in vars(states).items()})
        emitted = drafts[:2].tolist() + [7]
        if measured:
            counts["update"] = eager_ops(lambda: drafter.update(emitted, kept))
        else:
            drafter.update(emitted, kept)
    return counts


@torch.no_grad()
def tree_ops(target: Target, head: torch.nn.Module, spec: DynamicTree, backend: str = "inductor", max_len: int = 256
             ) -> int | None:
    """Eager ops of one dynamic (EAGLE-2) tree a compiled drafter grows after a prompt, its second (the first
    compiles); None for a drafter that grows no trees, or none of this shape (Medusa's: no deeper than its heads)."""
    drafter = drafter_for(head, max_len, compile=True, **({} if backend == "inductor" else {"backend": backend}))
    if not hasattr(drafter, "tree_root"):
        return None
    drafter.precompile(max(spec.depth + 1, spec.topk))
    runner = TargetRunner(target, max_len)
    prompt = torch.randint(3, min(1000, target.vocab_size), (1, 40), generator=torch.Generator().manual_seed(0))
    logits, states = runner.forward(prompt.to(runner.device))
    drafter.begin(prompt.to(runner.device), states, int(logits[0, -1].argmax()))
    try:
        build_dynamic_tree(drafter, spec, spec.depth)
    except ValueError:  # the drafter refuses the shape by name
        return None
    return eager_ops(lambda: build_dynamic_tree(drafter, spec, spec.depth))


@torch.no_grad()
def target_ops(target: Target, k: int, backend: str = "inductor", max_len: int = 256) -> dict[str, int]:
    """Eager ops around the compiled target's forward: a one-token step (plain decoding) and a k+1-token verify."""
    runner = TargetRunner(target, max_len, compile=True, backend=backend)
    runner.precompile([1, k + 1])
    prompt = torch.randint(3, min(1000, target.vocab_size), (1, 40), generator=torch.Generator().manual_seed(0))
    runner.forward(prompt.to(runner.device))
    runner.commit(prompt.shape[1])
    one, block = (torch.arange(5, 5 + n, device=runner.device).view(1, n) for n in (1, k + 1))
    runner.forward(one), runner.forward(block)  # the forward writes past the committed length: nothing to undo
    return {"step": eager_ops(lambda: runner.forward(one)), "verify": eager_ops(lambda: runner.forward(block))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="configs/demo/target")
    p.add_argument("--heads", nargs="+", default=["eagle3=configs/demo/eagle3-head", "mtp=configs/demo/mtp-head",
                                                    "medusa=configs/demo/medusa-head"])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--out", default=None, help="write the table to this markdown file")
    p.add_argument("--note", default="", help="a paragraph placed under the table")
    args = p.parse_args()
    target = Target.from_pretrained(TargetConfig(path=args.target, dtype="float32", device="cpu"))
    spec = DynamicTree()  # benchmark.py --tree's default
    rows = []
    for entry in args.heads:
        kind, path = entry.split("=", 1)
        head = load_head(kind, path, target)
        counts = round_ops(target, head, args.k)
        tree = tree_ops(target, head, spec)
        rows.append(f"| {kind} | `{path}` | {counts['propose']} | {counts['update']} | {counts['propose'] + counts['update']} "
                    f"| {'-' if tree is None else tree} |")
    target_counts = target_ops(target, args.k)
    body = (f"Target `{args.target}`, each head's drafter compiled (`--compile`'s path, inductor), chain k={args.k}; eager "
            "aten ops outside the compiled graphs (views and allocations left out), counted by torch.profiler on the "
            "second round: about the kernels each launches on a GPU.\n\n| head | draft | ops per propose | ops per update (3 tokens) | "
            f"per round | ops per dynamic tree (depth {spec.depth}, top-{spec.topk}, {spec.total_tokens} tokens) |\n"
            "|---|---|---|---|---|---|\n" + "\n".join(rows)
            + f"\n\nThe compiled target's forward itself, which plain decoding runs per token and a round once: "
            f"{target_counts['step']} eager ops around a one-token step, {target_counts['verify']} around a "
            f"{args.k + 1}-token verify.")
    print(body)
    if args.out:
        write_table(args.out, "Eager ops per round of a compiled drafter", body + ("\n\n" + args.note if args.note else ""))


if __name__ == "__main__":
    main()
