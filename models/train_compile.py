"""``train.compile``: the parts of a head its training step runs through ``torch.compile``.

A head names them (its class attribute ``compiled``: dotted paths from the head); the trainer compiles them the
same way for every head. Only pure tensor code is named: the norms, projections, rotary and MLP around the
attention. The loss's data-dependent parts (the trained positions' ``nonzero``, the TTT attention's blocks and
document masks, the fused Triton loss) stay eager, as do the target's forward and the optimizer.

Why parts, not the step: on a GPU a small head's training step is launch-bound (hundreds of small kernels per TTT
step), and fusing each part's elementwise kernels is where
that goes. On a CPU the step is matrix products (the measured step sits at its FLOP floor), and compiling gains
nothing there.
"""

from __future__ import annotations

import types
from typing import Iterable

import torch
from torch import nn


def compile_parts(head: nn.Module, names: Iterable[str], backend: str = "inductor") -> list[str]:
    """Compile each named part of ``head`` with dynamic shapes (a packed row's length changes every step, so a
    static compile would recompile each step). A name is a dotted path through modules to

    - a module: compiled in place (``nn.Module.compile``), so its parameter names, the checkpoints and the exports
      do not change;
    - a ``ModuleList``: each of its modules, likewise;
    - a method: replaced on its instance by the compiled function bound to that instance (a ``deepcopy`` of the head
      then binds it to the copy, not to this head's weights).

    A part the head's architecture lacks (an MTP block with no ``mlp``) is skipped; a path whose parents are not
    modules, or a list naming nothing, is refused. Compiling twice compiles once. Returns the paths compiled."""
    names, done = tuple(names), []
    for name in names:
        *parents, leaf = name.split(".")
        owner = head
        for part in parents:
            owner = getattr(owner, part, None)
            if not isinstance(owner, nn.Module):
                raise ValueError(f"{type(head).__name__}.compiled names {name!r}: {part!r} is not a module of the head")
        part = getattr(owner, leaf, None)
        if part is None:
            continue
        modules = list(part) if isinstance(part, nn.ModuleList) else [part] if isinstance(part, nn.Module) else None
        if modules is not None:
            for module in modules:
                if module._compiled_call_impl is None:
                    module.compile(dynamic=True, backend=backend)
        elif isinstance(part, types.MethodType) and part.__self__ is owner:
            if not hasattr(part.__func__, "_torchdynamo_orig_callable"):
                setattr(owner, leaf, types.MethodType(torch.compile(part.__func__, dynamic=True, backend=backend), owner))
        else:
            raise TypeError(f"{type(head).__name__}.compiled names {name!r}, which is neither a module nor a method")
        done.append(name)
    if not done:
        raise ValueError(f"{type(head).__name__}.compiled names no part of this head: {list(names)}")
    return done
