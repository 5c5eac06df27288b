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

    A ``*`` stands for each module of a ``ModuleDict``/``ModuleList`` (``layers.*.finish``: every later layer's); a
    part the head's architecture lacks (an MTP block with no ``mlp``, a one-layer draft's ``layers``) is skipped; a
    path whose parents are not modules, or a list naming nothing, is refused. Compiling twice compiles once. Returns
    the paths compiled (a ``*`` written out)."""
    names, done = tuple(names), []
    for name, owner, leaf in (found for name in names for found in parts_of(head, name)):
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


def parts_of(head: nn.Module, name: str) -> list[tuple[str, nn.Module, str]]:
    """(path, the module owning its last part, that part's name) for each part a dotted ``name`` of ``compiled``
    reaches (a ``*`` written out; none where the modules it ranges over are not in this head)."""
    *parents, leaf = name.split(".")
    owners: list[tuple[str, nn.Module]] = [("", head)]
    for part in parents:
        reached = []
        for path, owner in owners:
            if part == "*":
                if not isinstance(owner, (nn.ModuleDict, nn.ModuleList)):
                    raise ValueError(f"{type(head).__name__}.compiled names {name!r}: '*' follows no module list")
                reached += [(f"{path}{key}.", child) for key, child in owner.named_children()]
                continue
            child = getattr(owner, part, None)
            if child is None and "*" in parents:
                continue  # the modules a '*' would range over are not in this head (a one-layer draft's layers)
            if not isinstance(child, nn.Module):
                raise ValueError(f"{type(head).__name__}.compiled names {name!r}: {part!r} is not a module of the head")
            reached.append((f"{path}{part}.", child))
        owners = reached
    return [(path + leaf, owner, leaf) for path, owner in owners]
