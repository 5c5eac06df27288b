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


def test_muon_trains_hidden_matrices_and_leaves_every_token_table_to_adamw():
    """Under ``train.optimizer=muon`` the head's layer matrices go to Muon; its embeddings and lm_head, matrices with a
    side the size of its vocab (DSpark's Markov head, DFlash2's codebooks) and [1, n] rows (DSpark's confidence head), to
    AdamW."""
    from tiny_models import tiny_causal_lm

    from headstart.heads.dflash2.config import DFlash2Options
    from headstart.heads.dspark.config import DSparkOptions
    from headstart.heads.registry import build_head
    from headstart.models.head import DraftConfig
    from headstart.models.target import Target
    from headstart.trainer.config import TrainConfig
    from headstart.trainer.distributed import _optimizers

    target = Target(tiny_causal_lm("llama", num_hidden_layers=8))
    for name, options, tables in (("dspark", DSparkOptions(block_size=4, markov_rank=8, mask_token_id=9),
                                   {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
                                    "confidence_head.proj.weight"}),
                                  ("dflash2", DFlash2Options(block_size=4, selector_rank=8, mask_token_id=9),
                                   {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"})):
        head = build_head(DraftConfig(head=name, options=options), target, torch.ones(128))
        muon, adamw = _optimizers(head, TrainConfig(optimizer="muon"))
        names = {id(p): n for n, p in head.named_parameters()}
        in_muon = {names[id(p)] for group in muon.param_groups for p in group["params"]}
        in_adamw = {names[id(p)] for group in adamw.param_groups for p in group["params"]}
        assert tables <= in_adamw and not tables & in_muon, name
        assert {"fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight"} <= in_muon, name
