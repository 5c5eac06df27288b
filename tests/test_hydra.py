"""Hydra heads: the loss against a dense reference, the fresh start, greedy-exact decoding (chains, trees, batches),
the export round trip and refusals, and training through the shared trainer."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from tiny_models import random_features, tiny_causal_lm
from trainer_fixtures import make_setup, train_losses

from headstart.decode.generate import greedy_generate, speculative_generate
from headstart.decode.target_runner import TargetRunner
from headstart.decode.tree import DynamicTree, StaticTree
from headstart.heads.hydra.drafter import HydraDrafter
from headstart.heads.hydra.module import HydraConfig, HydraHeads, HydraOptions
from headstart.models.head import Features
from headstart.models.target import Target
from headstart.trainer.config import load_config
from headstart.trainer.run import build_trainer


@pytest.fixture(scope="module")
def target():
    return Target(tiny_causal_lm("llama", num_hidden_layers=8))


def heads_for(target, num_heads=3, num_layers=1, truncated=None, seed=0, **kwargs) -> HydraHeads:
    config = HydraConfig.from_target(target.config, HydraOptions(num_heads=num_heads, num_layers=num_layers,
                                                                 truncated_vocab_size=truncated))
    heads = HydraHeads(config, **kwargs)
    if truncated:
        heads.set_token_map(torch.arange(3, 3 + truncated) * (128 // (3 + truncated)))
    heads.set_target(target)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # away from the fresh start: every head reads its drafted tokens
        for head in heads.heads:
            head.proj.weight.add_(torch.randn(head.proj.weight.shape, generator=g) * 0.3)
            for layer in head.block.layers:
                layer.weight.normal_(0, 0.3, generator=g)
    return heads.eval()


def batch(target, B=2, T=19, seed=1) -> Features:
    return random_features(target, B, T, seed, cut=14)


@pytest.mark.parametrize("labels", ["target", "data"])
def test_loss_and_accuracy_equal_a_dense_reference(target, labels):
    heads = heads_for(target, labels=labels)
    f = batch(target)
    loss, metrics = heads.loss(f)
    h, ids = f.last_hidden_state, f.input_ids
    teacher = target.logits(h).float()
    B, T = ids.shape
    total, denominator = 0.0, f.loss_mask[:, 1:].sum()
    for s in range(3):
        losses, right = [], []
        for b, t in itertools.product(range(B), range(T - s - 2)):
            if not f.loss_mask[b, t + s + 2]:
                continue
            logits = heads.logits_of(s, h[b, t], ids[b, t + 1 : t + s + 2]).float()  # head s reads x_{t+1..t+1+s}
            logq = torch.log_softmax(logits, -1)
            label = teacher[b, t + s + 1]
            losses.append(-(torch.softmax(label, -1) * logq).sum() if labels == "target" else -logq[ids[b, t + s + 2]])
            right.append(float(logits.argmax() == label.argmax()))
        total = total + 0.8**s * torch.stack(losses).sum() / denominator
        assert metrics[f"acc_{s}"] == pytest.approx(sum(right) / len(right), abs=1e-6)
    torch.testing.assert_close(loss, total, rtol=1e-5, atol=1e-5)


def test_fresh_heads_start_as_the_targets_lm_head(target):
    config = HydraConfig.from_target(target.config, HydraOptions(num_heads=3))
    heads = HydraHeads(config)
    heads.set_target(target)
    h = target(torch.randint(3, 128, (1, 7))).last_hidden_state[0]
    for s in range(3):
        tokens = torch.randint(3, 128, (7, s + 1))
        torch.testing.assert_close(heads.logits_of(s, h, tokens), target.logits(h), rtol=1e-5, atol=1e-5)


def test_each_head_reads_the_drafts_before_it(target):
    heads = heads_for(target)
    h = target(torch.randint(3, 128, (1, 5))).last_hidden_state[0, -1]
    a, b = torch.tensor([5, 9, 11]), torch.tensor([5, 9, 40])
    assert torch.equal(heads.logits_of(1, h, a[:2]), heads.logits_of(1, h, b[:2]))  # head 1 reads two tokens
    assert not torch.allclose(heads.logits_of(2, h, a), heads.logits_of(2, h, b))  # head 2 reads the third


@pytest.mark.parametrize("truncated", [None, 48])
def test_decoding_is_greedy_exact_in_chains_trees_and_batches(target, truncated):
    from headstart.decode.batch_generate import batch_speculative_generate
    from headstart.decode.target_runner import RaggedRunner

    heads = heads_for(target, num_heads=4, truncated=truncated)
    runner = TargetRunner(target, max_len=160)
    prompts = [torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in (9, 5)]
    plain = []
    for prompt in prompts:
        runner.reset()
        plain.append(greedy_generate(runner, prompt, 30, set()).tokens)
    trees = (None, DynamicTree(depth=4, topk=3, total_tokens=10), StaticTree(((0,), (1,), (0, 0), (1, 0), (0, 0, 0))))
    for k, tree in itertools.product((1, 2, 4), trees):
        runner.reset()
        out = speculative_generate(runner, HydraDrafter(heads), prompts[0], 30, set(), k=k, tree=tree)
        assert out.tokens == plain[0], (k, tree)
    outs, _ = batch_speculative_generate(RaggedRunner(target, 160), HydraDrafter(heads), prompts, 30, set(), 3)
    assert [o.tokens for o in outs] == plain


def test_a_tree_nodes_children_depend_on_its_path(target):
    heads = heads_for(target)
    drafter = HydraDrafter(heads)
    states = target(torch.randint(3, 128, (1, 6)))
    drafter.begin(None, states, 7)
    root = drafter.tree_root()
    first = root.topk(2).indices
    children = drafter.tree_expand(torch.tensor([-1, -1]), first, 1)
    assert not torch.allclose(children[0], children[1])  # Medusa's would be equal
    torch.testing.assert_close(children[0], heads.logits_of(1, states.last_hidden_state[0, -1],
                                                            torch.tensor([7, int(first[0])])).float())


def test_export_round_trips_and_another_target_is_refused(target, tmp_path):
    heads = heads_for(target, truncated=48)
    heads.save_pretrained(tmp_path / "h", dtype=torch.float32)
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    assert config["architectures"] == ["HydraModel"] and config["draft_vocab_size"] == 48
    again = HydraHeads.load(tmp_path / "h", target)
    h = target(torch.randint(3, 128, (1, 4))).last_hidden_state[0, -1]
    for s in range(3):
        tokens = torch.arange(5, 6 + s)
        torch.testing.assert_close(again.logits_of(s, h, tokens), heads.logits_of(s, h, tokens))
    assert torch.equal(again.token_map, heads.token_map)
    other = Target(tiny_causal_lm("llama", num_hidden_layers=8, hidden_size=48))
    with pytest.raises(ValueError, match="hidden_size 32 != target hidden_size 48"):
        HydraHeads.load(tmp_path / "h", other)


def test_hydra_trains_through_the_shared_trainer(tmp_path):
    overrides = make_setup(tmp_path, head="hydra") + ["--draft.num_heads=3", "--train.max_steps=6", "--train.lr=3e-3"]
    trainer = build_trainer(load_config(None, overrides))
    final = trainer.train()
    assert {"acc_0", "acc_2", "sim_accept_len"} <= set(final)
    losses = train_losses(tmp_path / "run" / "metrics.jsonl")
    assert len(losses) == 6 and losses[-1] < losses[0]
    exported = HydraHeads.load(tmp_path / "run" / "final", trainer.features.target)
    assert exported.config.num_heads == 3 and HydraDrafter(exported).num_heads == 3
