"""``train.compile``: the parts of a head its training step runs through ``torch.compile``.

A head names them (its class attribute ``compiled``: dotted paths from the head); the trainer compiles them the
same way for every head. Only pure tensor code is named: the norms, projections, rotary and MLP around the
attention. The loss's data-dependent parts (the trained positions' ``nonzero``, the TTT attention's blocks and
document masks, the fused Triton loss) stay eager, as do the target's forward and the optimizer.

Why parts, not the step: on a GPU a small head's training step is launch-bound (hundreds of small kernels per TTT
step; BENCHMARKS.md "Online training throughput on a GPU"), and fusing each part's elementwise kernels is where
that goes. On a CPU the step is matrix products (the measured step sits at its FLOP floor), and compiling gains
nothing there.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn


def compile_parts(head: nn.Module, names: Iterable[str], backend: str = "inductor") -> list[str]:
    """Compile each named part of ``head`` with dynamic shapes (a packed row's length changes every step, so a
    static compile would recompile each step). A name is a dotted path to

    - a module: compiled in place (``nn.Module.compile``), so its parameter names, the checkpoints and the exports
      do not change;
    - a ``ModuleList``: each of its modules, likewise;
    - a method: replaced on its instance by the compiled bound method.

    A path the head's architecture lacks (an MTP block with no ``mlp``) is skipped. Returns the paths compiled."""
    done = []
    for name in names:
        *parents, leaf = name.split(".")
        owner = head
        for part in parents:
            owner = getattr(owner, part, None)
        part = getattr(owner, leaf, None) if owner is not None else None
        if part is None:
            continue
        if isinstance(part, nn.ModuleList):
            for module in part:
                module.compile(dynamic=True, backend=backend)
        elif isinstance(part, nn.Module):
            part.compile(dynamic=True, backend=backend)
        elif callable(part):
            setattr(owner, leaf, torch.compile(part, dynamic=True, backend=backend))
        else:
            raise TypeError(f"{type(head).__name__}.compiled names {name!r}, which is neither a module nor a method")
        done.append(name)
    return done
