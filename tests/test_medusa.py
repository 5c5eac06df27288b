"""Medusa heads: the loss against a dense reference, the vLLM layout, the tree construction, training."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch
from tiny_models import tiny_causal_lm
from trainer_fixtures import make_setup, train_losses

from headstart.heads.medusa.drafter import MedusaDrafter, rank_accuracy
from headstart.decode.target_runner import TargetRunner
from headstart.decode.tree import best_static_tree, expected_accept_length
from headstart.models.head import Features
from headstart.heads.medusa.module import MedusaConfig, MedusaHeads
from headstart.models.target import Target, TargetConfig
from headstart.trainer.batches import collate
from headstart.trainer.config import load_config
from headstart.trainer.run import build_trainer


@pytest.fixture(scope="module")
def target():
    return Target(tiny_causal_lm("llama", num_hidden_layers=8))


def heads_for(target, num_heads=3, num_layers=2, seed=0, **kwargs) -> MedusaHeads:
    heads = MedusaHeads(MedusaConfig.from_target(target.config, num_heads, num_layers), **kwargs)
    heads.load_target_lm_head(target.lm_head_weight)
    heads.set_teacher(target.vocab_head())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # away from the identity start, so every head differs
        for block in heads.blocks:
            for layer in block.layers:
                layer.weight.normal_(0, 0.3, generator=g)
                layer.bias.normal_(0, 0.3, generator=g)
    return heads


def batch(target, B=2, T=21, seed=1) -> Features:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    mask[1, 15:] = 0  # padding-like tail
    return Features(input_ids=ids, loss_mask=mask, last_hidden_state=target(ids).last_hidden_state)


def dense_reference(heads: MedusaHeads, target, f: Features, labels: str):
    """Per-head loss and top-1 accuracy, written the obvious way with full [B, T, V] tensors."""
    h = f.last_hidden_state
    logits_all = heads.head_logits(h).float()  # [K, B, T, V]
    teacher = target.logits(h).float()  # [B, T, V]
    B, T = f.input_ids.shape
    total, accs, chains = 0.0, [], []
    for k in range(heads.config.num_heads):
        i = k + 1
        losses, right, chain = [], [], []
        for b, t in itertools.product(range(B), range(T - i - 1)):
            if not f.loss_mask[b, t + i + 1]:
                continue
            logq = torch.log_softmax(logits_all[k, b, t], -1)
            if labels == "target":
                losses.append(-(torch.softmax(teacher[b, t + i], -1) * logq).sum())
            else:
                losses.append(-logq[f.input_ids[b, t + i + 1]])
            right.append(float(logits_all[k, b, t].argmax() == teacher[b, t + i].argmax()))
            # a greedy chain at t: heads 1..i all trained at t and all equal to the target's argmax
            if all(f.loss_mask[b, t + j + 1] for j in range(1, i)):
                chain.append(all(logits_all[j - 1, b, t].argmax() == teacher[b, t + j].argmax() for j in range(1, i + 1)))
        # summed over the trained positions, divided by the positions whose next token is trained
        total = total + heads.step_weight**k * torch.stack(losses).sum() / f.loss_mask[:, 1:].sum()
        accs.append(sum(right) / len(right))
        chains.append(sum(chain) / len(chain))
    return total, accs, 1.0 + sum(chains)


@pytest.mark.parametrize("labels", ["target", "data"])
def test_chunked_loss_and_gradients_equal_the_dense_reference(target, labels):
    f = batch(target)
    heads = heads_for(target, labels=labels, chunk_tokens=7)  # several chunks per head, a ragged last one
    loss, metrics = heads.loss(f)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in heads.named_parameters()}
    heads.zero_grad()
    ref, accs, sim_len = dense_reference(heads, target, f, labels)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    for n, p in heads.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    for k, acc in enumerate(accs):
        assert metrics[f"acc_{k}"] == pytest.approx(acc, abs=1e-6)
        assert metrics[f"acc_{k}"] <= metrics[f"top5_{k}"] <= 1.0
    assert metrics["sim_accept_len"] == pytest.approx(sim_len, abs=1e-6)


@pytest.mark.parametrize("labels", ["target", "data"])
def test_steps_that_are_not_logged_skip_top5_and_accept_and_train_the_same(target, labels):
    """The multi-step loss (Medusa's and MTP's) without ``full_metrics``: no top-5 or sum min(p, q), the same loss,
    gradients, acc_k and sim_accept_len. sum min(p, q) exists only against the target's distribution."""
    f = batch(target)
    heads = heads_for(target, labels=labels, chunk_tokens=7)
    metrics, grads = [], []
    for full in (True, False):
        heads.zero_grad()
        loss, m = heads.loss(dataclasses.replace(f, full_metrics=full))
        loss.backward()
        metrics.append({**m, "loss": float(loss)})
        grads.append({n: p.grad.clone() for n, p in heads.named_parameters()})
    full, light = metrics
    assert light["loss"] == full["loss"] and light["sim_accept_len"] == full["sim_accept_len"]
    for n, g in grads[0].items():
        assert torch.equal(g, grads[1][n]), n
    for k in range(heads.config.num_heads):
        assert light[f"acc_{k}"] == full[f"acc_{k}"] <= full[f"top5_{k}"] <= 1.0
        assert (f"accept_{k}" in full) == (labels == "target")
        assert f"top5_{k}" not in light and f"accept_{k}" not in light
    if labels == "target":
        assert all(0.0 < full[f"accept_{k}"] <= 1.0 for k in range(heads.config.num_heads))


def test_heads_that_match_the_target_everywhere_give_a_full_chain(target):
    """A constant hidden state makes the target's argmax the same token everywhere, and fresh heads (the
    target's lm_head) predict it: every head is right wherever it is trained, so a greedy chain accepts
    all K drafts -- also at the start of an assistant turn, where the first heads are not trained."""
    f = batch(target)
    f.last_hidden_state = torch.randn(32).expand_as(f.last_hidden_state).clone()
    heads = MedusaHeads(MedusaConfig.from_target(target.config, 4, 1))
    heads.load_target_lm_head(target.lm_head_weight)
    heads.set_teacher(target.vocab_head())
    _, metrics = heads.loss(f)
    assert [metrics[f"acc_{k}"] for k in range(4)] == [1.0] * 4
    assert metrics["sim_accept_len"] == pytest.approx(5.0)


def test_fresh_heads_start_as_the_targets_lm_head(target):
    heads = MedusaHeads(MedusaConfig.from_target(target.config, 4, 1))
    heads.load_target_lm_head(target.lm_head_weight)
    h = torch.randn(5, 32)
    for row in heads.head_logits(h):
        torch.testing.assert_close(row, target.logits(h))


def test_export_is_vllms_medusa_layout_and_round_trips(target, tmp_path):
    heads = heads_for(target, num_heads=3, num_layers=2)
    heads.save_pretrained(tmp_path / "m", dtype=torch.float32)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["MedusaModel"] and config["model_type"] == "medusa"
    assert (config["num_heads"], config["num_hidden_layers"], config["medusa_fc_bias"]) == (3, 2, True)
    assert config["truncated_vocab_size"] == config["vocab_size"] == 128
    # vLLM renames every key holding "num" and "heads"/"layers": only the two canonical ones may.
    assert [k for k in config if "num" in k] == ["num_heads", "num_hidden_layers"]
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "m" / "model.safetensors"))
    expected = {f"blocks.{i}.layers.{j}.{w}" for i in range(3) for j in range(2) for w in ("weight", "bias")}
    assert set(tensors) == expected | {f"lm_heads.{i}.weight" for i in range(3)}
    again = MedusaHeads.load(tmp_path / "m", target)
    for name, tensor in heads.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


def test_heads_for_another_target_are_refused_by_name(target, tmp_path):
    heads_for(target).save_pretrained(tmp_path / "m")
    other = Target(tiny_causal_lm("llama", num_hidden_layers=8, hidden_size=48, vocab_size=96))
    with pytest.raises(ValueError, match=r"hidden_size 32 != target hidden_size 48[\s\S]*vocab_size 128 != target vocab_size 96"):
        MedusaHeads.load(tmp_path / "m", other)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "num_heads": 4}))
    with pytest.raises(ValueError, match=r"missing \['blocks.3.layers.0.bias"):
        MedusaHeads.load(tmp_path / "m", target)


@pytest.mark.slow  # 29 s here: with CI's slow tests, out of the default suite's ten minutes
def test_best_static_tree_is_the_brute_force_optimum():
    acc = torch.tensor([[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.05]])
    nodes = [p for d in (1, 2, 3) for p in itertools.product(range(3), repeat=d)]
    for n in (1, 4, 7):
        tree = best_static_tree(acc, n)
        assert len(tree) == n and all(p[:-1] in tree for p in tree if len(p) > 1)  # prefix-closed
        best = max(expected_accept_length(list(c), acc) for c in itertools.combinations(nodes, n)
                   if all(p[:-1] in c for p in c if len(p) > 1))
        assert expected_accept_length(tree, acc) == pytest.approx(best)
    assert best_static_tree(acc, 3) == [(0,), (1,), (0, 0)]  # 0.6, 0.24 (0.6 x 0.4) > 0.2 > 0.18


def test_rank_accuracy_counts_the_targets_own_continuation(target):
    """Fresh heads all equal the target's lm_head, so head i's rank of token t+i+2 is the target's own
    rank of it at t: recomputed here from one plain forward over prompt + greedy continuation."""
    from headstart.decode.generate import greedy_generate

    heads = MedusaHeads(MedusaConfig.from_target(target.config, 2, 1))
    heads.load_target_lm_head(target.lm_head_weight)
    runner = TargetRunner(target, 128)
    prompt = torch.tensor([[5, 9, 17, 4, 9, 17, 4]])
    acc = rank_accuracy(runner, heads, [prompt], 30, set(), max_rank=40)
    seq = torch.tensor(prompt[0].tolist() + greedy_generate(runner, prompt, 30, set()).tokens)
    logits = target.logits(target(seq[None]).last_hidden_state)[0]  # [L, V]
    start = prompt.shape[1] - 1
    for i in (0, 1):
        t = torch.arange(start, len(seq) - i - 2)
        ranks = (logits[t] > logits[t, seq[t + i + 2]][:, None]).sum(-1)
        expected = torch.bincount(ranks, minlength=200)[:40].double() / len(t)
        torch.testing.assert_close(acc[i], expected)
    assert acc[:, :40].sum() > 0.5  # non-trivial: most true tokens rank in the top 40 of 128


def test_medusa_trains_through_the_shared_trainer(tmp_path):
    overrides = make_setup(tmp_path, head="medusa") + ["--draft.num_heads=3", "--train.max_steps=4",
                                        "--train.lr=3e-3"]
    trainer = build_trainer(load_config(None, overrides))
    assert trainer.features.needs == MedusaHeads.needs
    f = trainer.features(collate(trainer.train_data, [0, 1]))
    assert f.aux_hidden_states is None and f.target_logits is None and f.last_hidden_state is not None
    final = trainer.train()
    assert {"acc_0", "acc_2", "top5_1", "sim_accept_len"} <= set(final)
    losses = train_losses(tmp_path / "run" / "metrics.jsonl")
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    exported = MedusaHeads.load(tmp_path / "run" / "final", trainer.features.target)
    assert exported.config.num_heads == 3
    drafter = MedusaDrafter(exported)
    assert drafter.num_heads == 3


def test_medusa_tree_script_writes_a_tree_the_benchmark_reads(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from headstart.decode.tree import StaticTree

    make_setup(tmp_path)
    target = Target.from_pretrained(TargetConfig(path=str(tmp_path / "target"), dtype="float32"))
    heads_for(target, num_heads=3, num_layers=1).save_pretrained(tmp_path / "heads")
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"turns": [q]}) for q in ["What is 2+3?", "Say hello.", "Name a colour."]))
    script = Path(__file__).resolve().parents[1] / "scripts" / "medusa_tree.py"
    result = subprocess.run([sys.executable, str(script), "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "heads"),
                             "--questions", str(questions), "--max-new-tokens", "12", "--nodes", "6", "--max-rank", "4",
                             "--out", str(tmp_path / "tree.json")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    paths = [tuple(p) for p in json.loads((tmp_path / "tree.json").read_text())]
    tree = StaticTree(tuple(paths))  # prefix-closed and unique, or this raises
    assert len(tree.paths) == 6 and max(map(len, paths)) <= 3 and max(max(p) for p in paths) < 4
    assert "expected tau" in result.stdout and "| 3 |" in result.stdout


# -- a truncated vocab (vLLM's token_map) ------------------------------------------------------------

def truncated_heads(target, n=40, labels="target", seed=0) -> MedusaHeads:
    g = torch.Generator().manual_seed(seed)
    token_map = torch.randperm(128, generator=g)[:n].sort().values
    heads = MedusaHeads(MedusaConfig.from_target(target.config, 3, 1, truncated_vocab_size=n), labels=labels,
                        chunk_tokens=7)
    heads.set_token_map(token_map)
    heads.load_target_lm_head(target.lm_head_weight)
    heads.set_teacher(target.vocab_head())
    with torch.no_grad():
        for block in heads.blocks:
            for layer in block.layers:
                layer.weight.normal_(0, 0.3, generator=g)
    return heads


@pytest.mark.parametrize("labels", ["target", "data"])
def test_truncated_heads_loss_and_accuracy_by_hand(target, labels):
    """The loss is the cross-entropy against the target's distribution renormalised over token_map (or the data
    token, untrained when outside it); accuracy compares the mapped draft argmax with the target's FULL argmax."""
    f = batch(target)
    heads = truncated_heads(target, labels=labels)
    loss, metrics = heads.loss(f)
    loss.backward()
    tm = heads.token_map
    h = f.last_hidden_state
    teacher = target.logits(h).float()  # [B, T, V]
    B, T = f.input_ids.shape
    total, wrong_outside = 0.0, 0
    for k in range(3):
        losses, right = [], []
        for b, t in itertools.product(range(B), range(T - k - 2)):
            if not f.loss_mask[b, t + k + 2]:
                continue
            logq = torch.log_softmax(heads.logits_of(k, h[b, t]).float(), -1)  # [n]
            if labels == "target":
                losses.append(-(torch.softmax(teacher[b, t + k + 1, tm], -1) * logq).sum())
            elif (hit := (tm == f.input_ids[b, t + k + 2]).nonzero()).numel():
                losses.append(-logq[hit[0, 0]])
            full = teacher[b, t + k + 1].argmax()
            right.append(float(tm[logq.argmax()] == full))
            wrong_outside += int(full not in tm)
        total = total + heads.step_weight**k * torch.stack(losses).sum() / f.loss_mask[:, 1:].sum()
        assert metrics[f"acc_{k}"] == pytest.approx(sum(right) / len(right), abs=1e-6)
    torch.testing.assert_close(loss.detach(), total.detach(), rtol=1e-5, atol=1e-5)
    assert wrong_outside > 0  # the case the full-vocab comparison exists for does occur here


def test_truncated_export_is_vllms_token_map_layout_and_drafts_target_ids(target, tmp_path):
    from safetensors.torch import load_file

    heads = truncated_heads(target, n=40)
    heads.save_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["vocab_size"], config["truncated_vocab_size"]) == (128, 40)
    tensors = load_file(str(tmp_path / "m" / "model.safetensors"))
    assert tensors["token_map"].dtype == torch.int64 and torch.equal(tensors["token_map"], heads.token_map)
    assert all(tensors[f"lm_heads.{i}.weight"].shape == (40, 32) for i in range(3))
    again = MedusaHeads.load(tmp_path / "m", target)
    assert torch.equal(again.token_map, heads.token_map)
    # fresh rows are the target's lm_head rows of token_map
    fresh = MedusaHeads(MedusaConfig.from_target(target.config, 2, 1, truncated_vocab_size=40))
    fresh.set_token_map(heads.token_map)
    fresh.load_target_lm_head(target.lm_head_weight)
    x = torch.randn(4, 32)
    torch.testing.assert_close(fresh.logits_of(0, x), target.logits(x)[:, heads.token_map])
    # the drafter proposes target ids: token_map of each head's argmax
    drafter = MedusaDrafter(again.float())
    states = target(torch.randint(3, 128, (1, 6)))
    drafter.begin(None, states, 0)
    expected = heads.token_map[again.head_logits(states.last_hidden_state[0, -1]).argmax(-1)]
    assert torch.equal(drafter.propose(3), expected)
    assert bool(torch.isin(drafter.propose(3), heads.token_map).all())


def test_truncated_heads_decode_greedy_exact(target):
    from headstart.decode.generate import greedy_generate, speculative_generate
    from headstart.decode.tree import StaticTree

    heads = truncated_heads(target, n=64).eval()
    prompt = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(4))
    runner = TargetRunner(target, max_len=128)
    plain = greedy_generate(runner, prompt, 30, set()).tokens
    for tree in (None, StaticTree(paths=((0,), (1,), (0, 0), (0, 1), (0, 0, 0)))):
        runner.reset()
        out = speculative_generate(runner, MedusaDrafter(heads), prompt, 30, set(), k=3, tree=tree)
        assert out.tokens == plain
