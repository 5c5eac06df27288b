"""GatheredMuon (trainer/muon.py) is torch's Muon step for step on plain tensors; the sharded path is
tests/test_distributed.py::test_muon_on_two_fsdp_ranks_follows_one_process."""

from __future__ import annotations

import torch

from headstart.trainer.muon import GatheredMuon


def test_gathered_muon_equals_torchs_muon_on_plain_matrices():
    torch.manual_seed(0)
    shapes = [(16, 8), (8, 24)]
    ours = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    start = [p.detach().clone() for p in ours]
    kwargs = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    a, b = GatheredMuon(ours, **kwargs), torch.optim.Muon(theirs, **kwargs)
    for step in range(3):
        grads = [torch.randn(*s) for s in shapes]
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        a.step()
        b.step()
        for p, q in zip(ours, theirs):
            assert torch.equal(p, q), step
    assert all((p - p0).abs().max() > 1e-3 for p, p0 in zip(ours, start))  # it did train
    assert a.state_dict()["state"].keys() == b.state_dict()["state"].keys()
    assert torch.equal(a.state[ours[0]]["momentum_buffer"], b.state[theirs[0]]["momentum_buffer"])
