"""Early-exit self-speculation (the runner's ``forward_layers``: tests/test_target_runner.py): the adapter's loss
against a dense reference, the fresh adapter as plain early exit, greedy-exact chains, refusals by name, and training
through the shared trainer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_causal_lm
from trainer_fixtures import make_setup, train_losses

from headstart.decode.generate import greedy_generate, speculative_generate
from headstart.decode.target_runner import TargetRunner
from headstart.decode.tree import DynamicTree
from headstart.heads.early_exit.drafter import EarlyExitDrafter
from headstart.heads.methods import drafting_methods
from headstart.heads.early_exit.module import EarlyExitAdapter, EarlyExitOptions, build_early_exit
from headstart.models.export import export_head
from headstart.models.head import DraftConfig, Features
from headstart.models.provenance import fingerprint
from headstart.models.target import Target, TargetConfig
from headstart.models.target_matrices import TargetMatrices
from headstart.trainer.config import load_config
from headstart.trainer.run import build_trainer

E = 3


@pytest.fixture(scope="module")
def target_dir(llama8_dir):
    return llama8_dir


@pytest.fixture(scope="module")
def target(target_dir):
    return Target.from_pretrained(TargetConfig(path=str(target_dir), dtype="float32", aux_layer_ids=(E,)))


def adapter_for(target, seed=0, num_layers=1) -> EarlyExitAdapter:
    head = build_early_exit(DraftConfig(head="early-exit", options=EarlyExitOptions(num_layers=num_layers)), target,
                            torch.ones(128))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # away from the identity: the adapter changes what layer E says
        for layer in head.blocks.layers:
            layer.weight.normal_(0, 0.2, generator=g)
    return head.eval()


def test_a_fresh_adapter_is_plain_early_exit(target):
    head = build_early_exit(DraftConfig(head="early-exit", options=EarlyExitOptions()), target, torch.ones(128))
    h = torch.randn(5, 32)
    want = target.model.lm_head(target.base.norm(h))
    torch.testing.assert_close(head.draft_logits(h), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("loss", ["kl", "tv"])
def test_loss_equals_a_dense_reference(target, target_dir, loss):
    head = build_early_exit(DraftConfig(head="early-exit", loss=loss, options=EarlyExitOptions()), target,
                            torch.ones(128))
    with torch.no_grad():
        head.blocks.layers[0].weight.normal_(0, 0.2, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 128, (2, 15), generator=g)
    mask = (torch.rand(2, 15, generator=g) > 0.3).long()
    out = target(ids)
    f = Features(input_ids=ids, loss_mask=mask, aux_hidden_states=out.aux_hidden_states,
                 last_hidden_state=out.last_hidden_state)
    got, metrics = head.loss(f)
    logq = F.log_softmax(head.draft_logits(out.aux_hidden_states).float(), -1)  # position t predicts t+1
    logp = F.log_softmax(target.logits(out.last_hidden_state).float(), -1)
    dense = -(logp.exp() * logq).sum(-1) if loss == "kl" else 0.5 * (logp.exp() - logq.exp()).abs().sum(-1)
    trained = mask[:, 2:].bool()
    torch.testing.assert_close(got, dense[:, 1:-1][trained].sum() / mask[:, 1:].sum(), atol=1e-5, rtol=1e-5)
    right = (logq.argmax(-1) == logp.argmax(-1))[:, 1:-1][trained].float().mean().item()
    assert metrics["acc_0"] == pytest.approx(right)
    # The exit layer among several captured ones: the same loss from its slice of the features.
    several = Target.from_pretrained(TargetConfig(path=str(target_dir), dtype="float32", aux_layer_ids=(1, E, 6)))
    picked = build_early_exit(DraftConfig(head="early-exit", loss=loss, options=EarlyExitOptions(exit_layer=E)), several,
                              torch.ones(128))
    picked.load_state_dict(head.state_dict())
    wide = several(ids)
    assert picked.aux_index == 1 and wide.aux_hidden_states.shape[-1] == 3 * 32
    got_wide, _ = picked.loss(Features(input_ids=ids, loss_mask=mask, aux_hidden_states=wide.aux_hidden_states,
                                       last_hidden_state=wide.last_hidden_state))
    torch.testing.assert_close(got_wide, got, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_chains_are_greedy_exact(target, k):
    head = adapter_for(target)
    runner = TargetRunner(target, 96, with_aux=False)
    prompt = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(4))
    want = greedy_generate(runner, prompt, 30, set()).tokens
    out = speculative_generate(runner, EarlyExitDrafter(head), prompt, 30, set(), k=k)
    assert out.tokens == want
    assert sum(out.proposed) > 0


def test_verification_runs_the_first_layers_once_per_token(target):
    """LayerSkip's reuse: drafting ran x, d_1..d_{k-1} through layers 0..E-1; verification runs only d_k there, so
    the first layer sees exactly the tokens the last one does (not k more per round), and the output stays greedy."""
    head = adapter_for(target, seed=1)
    runner = TargetRunner(target, 96, with_aux=False)
    prompt = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(5))
    want = greedy_generate(runner, prompt, 30, set()).tokens
    seen = {0: 0, len(target.base.layers) - 1: 0}
    hooks = [target.base.layers[i].register_forward_hook(
        lambda m, a, o, i=i: seen.__setitem__(i, seen[i] + (o[0] if isinstance(o, tuple) else o).shape[1]))
        for i in seen]
    try:
        out = speculative_generate(runner, EarlyExitDrafter(head), prompt, 30, set(), k=4)
    finally:
        for h in hooks:
            h.remove()
    assert out.tokens == want
    assert sum(out.proposed) > len(out.proposed)  # chains of more than one draft: the reuse had something to skip
    assert seen[0] == seen[len(target.base.layers) - 1] == prompt.shape[1] + sum(p + 1 for p in out.proposed)
    assert drafting_methods()["early-exit"].capabilities.reads_aux is False  # the benchmark's runner: no aux states to build


def test_what_it_cannot_do_is_refused_by_name(target, target_dir, tmp_path):
    three = Target.from_pretrained(TargetConfig(path=str(target_dir), dtype="float32"))  # aux layers 2, 4, 5
    with pytest.raises(ValueError, match=r"set draft.exit_layer to one of target.aux_layer_ids \[2, 4, 5\]"):
        build_early_exit(DraftConfig(head="early-exit", options=EarlyExitOptions()), three, torch.ones(128))
    with pytest.raises(ValueError, match=r"draft.exit_layer 3 is not among target.aux_layer_ids \[2, 4, 5\]"):
        build_early_exit(DraftConfig(head="early-exit", options=EarlyExitOptions(exit_layer=3)), three, torch.ones(128))
    with pytest.raises(ValueError, match="draft.num_layers must be >= 1"):
        EarlyExitOptions(num_layers=0)
    head = adapter_for(target)
    runner = TargetRunner(target, 96, with_aux=False)
    prompt = torch.randint(3, 128, (1, 9))
    with pytest.raises(ValueError, match="chains only"):
        speculative_generate(runner, EarlyExitDrafter(head), prompt, 10, set(), k=2,
                             tree=DynamicTree(depth=2, topk=2, total_tokens=4))
    with pytest.raises(ValueError, match="one sequence at a time"):
        EarlyExitDrafter(head).begin_batch([prompt], None, [1])
    export_head(head, tmp_path / "out", "early-exit", fingerprint(target_dir))
    other = tmp_path / "other"
    tiny_causal_lm("llama", num_hidden_layers=10).save_pretrained(other)
    with pytest.raises(ValueError, match="target_num_layers 8 != the target's 10"):
        EarlyExitAdapter.load(tmp_path / "out", TargetMatrices(TargetConfig(path=str(other), dtype="float32")))


def test_export_round_trips_offline_and_online(target, target_dir, tmp_path):
    head = adapter_for(target, seed=3)
    export_head(head, tmp_path / "out", "early-exit", fingerprint(target_dir))
    h = torch.randn(4, 32)
    for reader in (target, TargetMatrices(TargetConfig(path=str(target_dir), dtype="float32"))):
        loaded = EarlyExitAdapter.load(tmp_path / "out", reader)
        torch.testing.assert_close(loaded.draft_logits(h), head.draft_logits(h), atol=0.05, rtol=0.05)  # bf16 weights
        assert loaded.config.exit_layer == E


def test_trains_through_the_shared_trainer(tmp_path):
    overrides = make_setup(tmp_path, head="early-exit") + [f"--target.aux_layer_ids=[{E}]", f"--draft.exit_layer={E}",
                                                           "--train.max_steps=8", "--train.lr=1e-2"]
    trainer = build_trainer(load_config(None, overrides))
    final = trainer.train()
    assert {"acc_0", "sim_accept_len"} <= set(final)
    losses = train_losses(tmp_path / "run" / "metrics.jsonl")
    assert len(losses) == 8 and losses[-1] < losses[0]
    loaded = EarlyExitAdapter.load(tmp_path / "run" / "final", trainer.features.target)
    assert loaded.config.exit_layer == E and EarlyExitDrafter(loaded).exit_layer == E
