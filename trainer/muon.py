"""Muon on FSDP2's row-sharded matrices with one gather per matrix and step.

torch.optim.Muon runs its Newton-Schulz iteration (five quintic steps, each a few matrix products) on whatever the
parameter is. Under FSDP2 that is a DTensor sharded by rows, so every product of the iteration is a collective:
on 2 CPU gloo ranks the demo recipe's step took 1.27 s with Muon against 1.04 s with AdamW, where
one process pays 25 ms for it. ``GatheredMuon`` keeps torch's Muon -- its hyper-parameters, its state
(``momentum_buffer``, so checkpoints are the same) and its update -- and differs only in where the orthogonalisation
runs: the momentum is kept on the shards (it is element-wise), the update is gathered whole once, orthogonalised
locally (every rank computes the same), and each rank keeps its own rows.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz


def orthogonalise(update: torch.Tensor, group: dict) -> torch.Tensor:
    """Newton-Schulz on the whole matrix: a DTensor is replicated first (one all-gather) and sharded back after
    (a local slice); a plain tensor as it is."""
    ns = lambda x: _zeropower_via_newtonschulz(x, group["ns_coefficients"], group["ns_steps"], group["eps"])  # noqa: E731
    if not isinstance(update, DTensor):
        return ns(update)
    placements = update.placements
    whole = update.redistribute(placements=[Replicate()] * len(placements))
    local = ns(whole.to_local())  # a plain tensor: no collective inside the iteration
    return DTensor.from_local(local, update.device_mesh, [Replicate()] * len(placements)).redistribute(placements=placements)


class GatheredMuon(torch.optim.Muon):
    """``torch.optim.Muon`` whose orthogonalisation gathers each sharded matrix once (see the module docstring)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                update = orthogonalise(update, group)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-_adjust_lr(group["lr"], group["adjust_lr_fn"], p.shape))
        return loss
