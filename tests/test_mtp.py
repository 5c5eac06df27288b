"""MTP: the unrolled loss and attention pattern, drafting consistent with training, native checkpoints
(DeepSeek-V3 and Qwen3-Next layouts: read, train, write back, load as the target), the dense layout."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny_models import tiny_causal_lm
from trainer_fixtures import make_setup, train_losses
from transformers import AutoConfig, AutoModelForCausalLM

from headstart.heads.mtp.drafter import MTPDrafter
from headstart.models.head import Features
from headstart.heads.mtp.module import MTPHead, build_mtp
from headstart.heads.mtp.checkpoint import find_native_layout, native_name, split_experts
from headstart.models.target import Target, TargetConfig
from headstart.trainer.config import load_config
from headstart.trainer.run import build_trainer


def randomized(head: MTPHead, seed: int = 0) -> MTPHead:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.requires_grad:
                p.normal_(1.0 if "norm" in name else 0.0, 0.2, generator=g)
    return head


@pytest.fixture(scope="module")
def target():
    return Target(tiny_causal_lm("llama", num_hidden_layers=8))


def features(target, B=2, T=16, seed=1) -> Features:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.25).long()
    return Features(input_ids=ids, loss_mask=mask, last_hidden_state=target(ids).last_hidden_state)


def test_loss_is_the_weighted_soft_cross_entropy_of_each_unrolled_step(target):
    head = randomized(build_mtp(target, unroll=3, chunk_tokens=5))
    f = features(target)
    loss, metrics = head.loss(f)
    with torch.no_grad():
        steps = list(head.unroll(f))
    teacher = target.logits(f.last_hidden_state).float()  # [B, T, V]
    B, T = f.input_ids.shape
    expected = 0.0
    for j, hidden in enumerate(steps):
        logq = torch.log_softmax(head.logits(hidden).float(), -1)
        terms = [-(torch.softmax(teacher[b, t + 1 + j], -1) * logq[b, t]).sum()
                 for b in range(B) for t in range(T - j - 2) if f.loss_mask[b, t + 2 + j]]
        expected += 0.8**j * torch.stack(terms).sum() / f.loss_mask[:, 1:].sum()  # over trained positions
        right = [float(logq[b, t].argmax() == teacher[b, t + 1 + j].argmax())
                 for b in range(B) for t in range(T - j - 2) if f.loss_mask[b, t + 2 + j]]
        assert metrics[f"acc_{j}"] == pytest.approx(sum(right) / len(right), abs=1e-6)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)


def test_step_j_sees_step_0_causally_and_only_its_own_position_of_later_steps(target):
    """Changing token t+1 of step 0 changes outputs at >= t only; h_j at t depends on later positions never."""
    head = randomized(build_mtp(target, unroll=3))
    f = features(target, B=1, T=12)
    with torch.no_grad():
        before = list(head.unroll(f))
        f.input_ids[0, 7] = (f.input_ids[0, 7] + 1) % 128  # token 7: step 0 reads it at t=6, step 1 at t=5, step 2 at t=4
        after = list(head.unroll(f))
    for j, (a, b) in enumerate(zip(before, after)):
        first = 6 - j  # the first position that read the changed token at step j
        torch.testing.assert_close(a[0, :first], b[0, :first])  # nothing earlier moved
        assert not torch.allclose(a[0, first], b[0, first])


def test_drafter_steps_equal_the_training_unroll(target):
    head = randomized(build_mtp(target, unroll=3))
    ids = torch.randint(3, 128, (1, 14), generator=torch.Generator().manual_seed(4))
    out = target(ids)
    f = Features(input_ids=ids, loss_mask=torch.ones_like(ids), last_hidden_state=out.last_hidden_state)
    with torch.no_grad():
        steps = [head.logits(h)[0] for h in head.unroll(f)]  # each [T, V]
    for t in (3, 6, 9):
        drafter = MTPDrafter(head, 64)
        drafter.begin(ids[:, : t + 1], out.select(slice(0, t + 1)), int(ids[0, t + 1]))
        torch.testing.assert_close(drafter.last_logits, steps[0][t].float(), rtol=1e-4, atol=1e-4)
        hidden = drafter.last_hidden
        for i in range(1, 3):  # feed the true tokens back, as teacher forcing does
            hidden = drafter._step(hidden, ids[:, t + 1 + i].view(1, 1), drafter.cache.length - 1 + i)
            torch.testing.assert_close(head.logits(hidden)[0, -1].float(), steps[i][t].float(), rtol=1e-4, atol=1e-4)


def test_dense_layout_round_trips_and_refuses_another_target(target, tmp_path):
    head = randomized(build_mtp(target, unroll=2))
    head.save_pretrained(tmp_path / "mtp", dtype=torch.float32)
    assert json.loads((tmp_path / "mtp" / "config.json").read_text())["architectures"] == ["HeadstartMTP"]
    tensors = load_file(str(tmp_path / "mtp" / "model.safetensors"))
    assert "embed_tokens.weight" not in tensors and {"eh_proj.weight", "enorm.weight", "norm.weight"} <= set(tensors)
    again = MTPHead.load(tmp_path / "mtp", target)
    for name, tensor in head.export_state_dict().items():
        assert torch.equal(again.export_state_dict()[name], tensor), name
    other = Target(tiny_causal_lm("llama", num_hidden_layers=8, hidden_size=48))
    with pytest.raises(ValueError, match="hidden_size 32 != target hidden_size 48"):
        MTPHead.load(tmp_path / "mtp", other)


# -- native checkpoints ------------------------------------------------------------------------------
NATIVE_CONFIGS = {
    "deepseek": ("deepseek_v3", dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                     num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                                     num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
                                     q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=1,
                                     topk_group=1, num_nextn_predict_layers=1, max_position_embeddings=256)),
    "qwen3_next": ("qwen3_next", dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                      num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=16,
                                      linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                                      linear_value_head_dim=8, linear_conv_kernel_dim=4, full_attention_interval=4,
                                      max_position_embeddings=256)),
}


def native_checkpoint(root, layout: str, shards: bool):
    """A tiny target checkpoint whose safetensors also carry an MTP layer under its real names."""
    family, kwargs = NATIVE_CONFIGS[layout]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **kwargs))
    model.save_pretrained(root, max_shard_size="200KB" if shards else "1GB")
    target = Target.from_pretrained(TargetConfig(path=str(root), dtype="float32"))
    mtp = randomized(build_mtp(target), seed=3)  # the checkpoint has no MTP yet: a fresh layer to plant
    planted = split_experts({native_name(k, layout, 8): v.contiguous() for k, v in mtp.export_state_dict().items()})
    # The planted layer is named exactly as transformers itself saves such a layer (experts one by one):
    # DeepSeek's layer 8 mirrors saved layer 7, Qwen3-Next's mtp.layers.0 mirrors saved full-attention layer 3.
    if shards:
        saved = list(json.loads((root / "model.safetensors.index.json").read_text())["weight_map"])
    else:
        with safe_open(str(root / "model.safetensors"), framework="pt") as fh:
            saved = list(fh.keys())
    own, like = ("model.layers.8.", "model.layers.7.") if layout == "deepseek" else ("mtp.layers.0.", "model.layers.3.")
    block_names = {n[len(own):] for n in planted if n.startswith(own)} - {"enorm.weight", "hnorm.weight", "eh_proj.weight",
                                                                       "shared_head.norm.weight"}
    assert block_names == {n[len(like):] for n in saved if n.startswith(like)}
    assert ("mlp.experts.0.gate_proj.weight" in block_names and "mlp.experts.3.down_proj.weight" in block_names)
    if layout == "deepseek":  # DeepSeek also stores copies of the embedding and head with its MTP layer
        planted["model.layers.8.embed_tokens.weight"] = target.embed_tokens.weight.detach().clone()
        planted["model.layers.8.shared_head.head.weight"] = target.lm_head_weight.detach().clone()
    index = root / "model.safetensors.index.json"
    if shards:  # the MTP layer in a shard of its own, as DeepSeek ships it, plus one tensor in a mixed shard
        weight_map = json.loads(index.read_text())["weight_map"]
        mixed_name = sorted(planted)[0]
        first = root / sorted(set(weight_map.values()))[0]
        mixed = dict(load_file(str(first)), **{mixed_name: planted.pop(mixed_name)})
        save_file(mixed, str(first), metadata={"format": "pt"})
        save_file(planted, str(root / "model-mtp-original.safetensors"), metadata={"format": "pt"})
        weight_map.update({mixed_name: first.name, **{k: "model-mtp-original.safetensors" for k in planted}})
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    else:
        save_file({**load_file(str(root / "model.safetensors")), **planted}, str(root / "model.safetensors"),
                  metadata={"format": "pt"})
    return mtp


@pytest.mark.parametrize("layout,shards", [("deepseek", True), ("deepseek", False), ("qwen3_next", False)])
def test_native_mtp_is_read_trained_written_back_and_loads_as_the_target(tmp_path, layout, shards):
    src = tmp_path / "src"
    planted = native_checkpoint(src, layout, shards)
    target = Target.from_pretrained(TargetConfig(path=str(src), dtype="float32"))
    assert find_native_layout(src, 8) == layout
    head = build_mtp(target, unroll=2)
    for name, tensor in planted.export_state_dict().items():  # read: the planted tensors, under their real names
        assert torch.equal(head.export_state_dict()[name], tensor), name
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    f = features(target)
    for _ in range(3):
        loss, _ = head.loss(f)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    head.save_pretrained(tmp_path / "out")
    out = tmp_path / "out"
    shards_out = sorted(p.name for p in out.glob("*.safetensors"))
    linked = [p for p in out.glob("*.safetensors") if p.is_symlink()]
    if shards:  # shards without MTP tensors are links; one holding some is rewritten without them
        assert linked and all(not (out / n).is_symlink() for n in ("model-mtp-original.safetensors", "model-mtp.safetensors"))
        with safe_open(str(out / "model-mtp-original.safetensors"), framework="pt") as f:  # the copies DeepSeek keeps
            assert set(f.keys()) == {"model.layers.8.embed_tokens.weight", "model.layers.8.shared_head.head.weight"}
    assert "model-mtp.safetensors" in shards_out
    again = MTPHead.load(out, target)
    for name, tensor in head.export_state_dict().items():
        assert torch.equal(again.export_state_dict()[name], tensor.detach()), name
    changed = [k for k, v in head.export_state_dict().items() if not torch.equal(v, planted.export_state_dict()[k])]
    assert changed  # training moved the layer
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    for name in weight_map:  # every tensor exactly once, where the index says
        with safe_open(str(out / weight_map[name]), framework="pt") as f:
            assert name in f.keys()
    assert sum(1 for f in shards_out for _ in safe_open(str(out / f), framework="pt").keys()) == len(weight_map)
    if layout == "deepseek":
        assert "model.layers.8.shared_head.head.weight" in weight_map  # the copies DeepSeek keeps are kept
    reloaded = AutoModelForCausalLM.from_pretrained(out)  # still the target, to transformers
    original = AutoModelForCausalLM.from_pretrained(src)
    ids = torch.randint(0, 128, (1, 9))
    torch.testing.assert_close(reloaded(ids).logits, original(ids).logits)


def test_mtp_trains_through_the_shared_trainer_online_and_offline(tmp_path):
    overrides = make_setup(tmp_path, head="mtp") + ["--draft.ttt_steps=2", "--train.max_steps=3",
                                        "--target.dtype=bfloat16", "--features.samples_per_shard=8"]
    from headstart.scripts import generate_features as gf

    manifest = gf.generate(load_config(None, [*overrides, f"--features.path={tmp_path / 'store'}"]))
    assert manifest["storage"] == {"aux": None, "hidden": "bf16", "topk": None}
    online = build_trainer(load_config(None, [*overrides, f"--output_dir={tmp_path / 'on'}"]))
    offline = build_trainer(load_config(None, [*overrides, f"--output_dir={tmp_path / 'off'}",
                                               f"--features.path={tmp_path / 'store'}"]))
    # The offline head is built without the target model (its classes from a meta-device copy, its
    # block from the safetensors) and starts exactly where the online one does.
    a, b = online.backend.module.export_state_dict(), offline.backend.module.export_state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert offline.train_step()["loss"] == pytest.approx(online.train_step()["loss"], abs=1e-5)
    final = online.train()
    assert {"acc_0", "acc_1", "top5_0", "sim_accept_len"} <= set(final)
    assert len(train_losses(tmp_path / "on" / "metrics.jsonl")) == 3
    assert MTPHead.load(tmp_path / "on" / "final", online.features.target).unroll_steps == 2
    assert os.path.isfile(tmp_path / "on" / "final" / "config.json")


def test_offline_reads_moe_layers_as_the_online_target_holds_them_and_refuses_fp8(tmp_path):
    from headstart.heads.mtp.checkpoint import fuse_experts, write_target_with_mtp
    from headstart.heads.mtp.module import read_native_mtp
    from headstart.models.target_matrices import TargetMatrices

    native_checkpoint(tmp_path / "src", "deepseek", shards=False)
    online = Target.from_pretrained(TargetConfig(path=str(tmp_path / "src"), dtype="float32"))
    offline = TargetMatrices(TargetConfig(path=str(tmp_path / "src"), dtype="float32"))
    a, b = online.layer_state(7), fuse_experts(offline.layer_state(7))  # checkpoint: one tensor per expert
    assert "mlp.experts.gate_up_proj" in a and set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    head = read_native_mtp(tmp_path / "src", online)
    with pytest.raises(ValueError, match="would overwrite the files it is read from"):
        write_target_with_mtp(tmp_path / "src", tmp_path / "src", head.export_state_dict(), "deepseek", 8)
    tensors = load_file(str(tmp_path / "src" / "model.safetensors"))
    tensors["model.layers.8.eh_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, str(tmp_path / "src" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"FP8 block-quantized \(model.layers.8.eh_proj.weight_scale_inv\)"):
        read_native_mtp(tmp_path / "src", online)


def test_proposals_and_trees_follow_the_training_positions(target):
    """propose(k) feeds its own drafts back: the training unroll over those tokens gives the same argmaxes;
    a tree of width 1 is that chain."""
    from headstart.decode.tree import DynamicTree, build_dynamic_tree

    head = randomized(build_mtp(target, unroll=3), seed=7)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(5))
    t = 8
    out = target(ids[:, : t + 1])
    drafter = MTPDrafter(head, 64)
    drafter.begin(ids[:, : t + 1], out, int(ids[0, t + 1]))
    drafts = drafter.propose(3)
    fed = torch.cat([ids[:, : t + 2], drafts[:2].view(1, 2)], dim=1)  # step i reads draft i at t+1+i
    f = Features(input_ids=fed, loss_mask=torch.ones_like(fed), last_hidden_state=target(fed).last_hidden_state)
    with torch.no_grad():
        argmaxes = [int(head.logits(h)[0, t].argmax()) for h in head.unroll(f)]
    assert argmaxes == drafts.tolist()
    tree = build_dynamic_tree(drafter, DynamicTree(3, 1, 3), max_depth=10)
    assert tree.tokens.tolist() == drafts.tolist() and tree.parents.tolist() == [-1, 0, 1]


@pytest.mark.parametrize("family", ["llama", "deepseek", "qwen3_next"])
def test_training_unroll_runs_the_memory_linear_ttt_attention_equal_to_the_masked_one(family, monkeypatch):
    """The unroll's attention goes through models/ttt_attention.py (no [T, (j+1)T] mask, blocks of query rows)
    and gives the additive mask + SDPA's loss and gradients: GQA (Qwen3-Next), MLA with its own scaling and
    a value head dim unlike the query's (DeepSeek-V3)."""
    import headstart.heads.mtp.module as mtp

    if family == "llama":
        model = tiny_causal_lm("llama", num_hidden_layers=8)
    else:
        name, kwargs = NATIVE_CONFIGS[family]
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(name, **kwargs))
    target = Target(model)
    head = randomized(build_mtp(target, unroll=3, chunk_tokens=7), seed=2)
    assert head.block_attention == "headstart_ttt"
    f = features(target, B=2, T=30)

    def run():
        head.zero_grad()
        loss, metrics = head.loss(f)
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}

    monkeypatch.setattr(mtp, "TTT_BLOCK", 8)  # 30 positions: 4 checkpointed blocks
    with monkeypatch.context() as m:
        m.setattr(mtp, "additive_mask", lambda *a: pytest.fail("the linear path built a [T, (j+1)T] mask"))
        loss, grads = run()
    head.block_attention = "sdpa"  # the masked path, as before
    head.block.self_attn.config._attn_implementation = "sdpa"
    want_loss, want_grads = run()
    assert loss == pytest.approx(want_loss, rel=1e-5)
    assert set(grads) == set(want_grads) and len(grads) > 5
    for name in grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-4, atol=1e-6, msg=name)
