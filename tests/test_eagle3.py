"""EAGLE-3 head: TTT against a naive inference-style reference, draft vocab, server layout."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import tiny_causal_lm

from headstart.models.draft_vocab import build_draft_vocab, check_draft_vocab, count_tokens
from headstart.heads.eagle3.module import Eagle3Config, Eagle3Draft
from headstart.models.head import DraftHead, Features

V, H = 128, 32


def tiny_draft(ttt_steps=4, draft_vocab=48, seed=0, num_layers=1) -> Eagle3Draft:
    target = tiny_causal_lm("llama", num_hidden_layers=8)
    config = Eagle3Config.from_target(target.config, draft_vocab_size=draft_vocab, num_layers=num_layers)
    torch.manual_seed(seed)
    draft = Eagle3Draft(config, ttt_steps=ttt_steps)
    for p in draft.parameters():  # random weights everywhere, norms included, so nothing cancels
        torch.nn.init.normal_(p, std=0.2)
    counts = torch.randint(0, 50, (V,))
    draft.set_draft_vocab(*build_draft_vocab(counts, draft_vocab))
    return draft


def random_features(draft: Eagle3Draft, B=2, T=10, seed=1) -> Features:
    g = torch.Generator().manual_seed(seed)
    vd = draft.config.draft_vocab_size
    loss_mask = (torch.rand(B, T, generator=g) > 0.3).long()
    loss_mask[1, -3:] = 0  # padding at the end of row 1
    return Features(
        input_ids=torch.randint(0, V, (B, T), generator=g),
        loss_mask=loss_mask,
        aux_hidden_states=torch.randn(B, T, 3 * H, generator=g),
        target_logits=torch.randn(B, T, vd, generator=g) * 3,
        target_in_draft=torch.rand(B, T, generator=g) > 0.2,
    )


def naive_ttt_loss(draft: Eagle3Draft, f: Features) -> list[float]:
    """Per-step losses computed position by position, as the drafter runs at inference:
    a KV cache holding the step-0 keys of positions <= t, then one key per draft step at t."""
    attn = draft.midlayer.self_attn
    B, T = f.input_ids.shape
    hidden0 = draft.fc(f.aux_hidden_states)
    pos0 = torch.arange(T).unsqueeze(0).expand(B, T)
    cos, sin = draft.rotary_emb(hidden0, pos0)
    emb0 = draft.embed_tokens(torch.cat([f.input_ids[:, 1:], torch.zeros(B, 1, dtype=torch.long)], 1))
    _, k0, v0 = attn.qkv(draft.midlayer.attn_input(emb0, hidden0), cos, sin)  # step-0 keys of every position
    valid = torch.zeros(B, T, dtype=torch.bool)
    valid[:, :-1] = f.loss_mask[:, 1:].bool() & f.target_in_draft[:, :-1]
    losses = [[0.0, 0] for _ in range(draft.ttt_steps)]
    for b in range(B):
        for t in range(T):
            h = hidden0[b : b + 1, t : t + 1]  # [1, 1, H]
            keys, vals = k0[b : b + 1, :, : t + 1], v0[b : b + 1, :, : t + 1]
            for k in range(draft.ttt_steps):
                j = t + 1 + k  # the token fed at this step, and the target position predicting t+2+k
                tok = f.input_ids[b, j] if j < T else torch.tensor(0)
                emb = draft.embed_tokens(tok.view(1, 1))
                c, s = draft.rotary_emb(h, torch.tensor([[t + k]]))
                q, key, val = attn.qkv(draft.midlayer.attn_input(emb, h), c, s)
                if k > 0:
                    keys, vals = torch.cat([keys, key], 2), torch.cat([vals, val], 2)
                w = torch.softmax((q @ keys.transpose(-1, -2)) / math.sqrt(attn.head_dim), -1)
                out = attn.o_proj((w @ vals).transpose(1, 2).reshape(1, 1, -1))
                h = draft.midlayer.finish(h, out)
                if j < T and valid[b, j]:
                    logq = torch.log_softmax(draft.lm_head(draft.norm(h))[0, 0].float(), -1)
                    p = torch.softmax(f.target_logits[b, j].float(), -1)
                    losses[k][0] += -(p * logq).sum().item()
                    losses[k][1] += 1
    return losses  # per step: [summed loss, trained positions]


def test_ttt_matches_naive_inference_reference():
    draft = tiny_draft(ttt_steps=4)
    f = random_features(draft)
    total, metrics = draft.loss(f)
    reference = naive_ttt_loss(draft, f)
    for k, (summed, n) in enumerate(reference):
        assert metrics[f"loss_{k}"] == pytest.approx(summed / max(n, 1), abs=1e-5), f"step {k}"
    # The loss: the steps' sums over the positions whose next token is trained (not each step's mean).
    trained = int(f.loss_mask[:, 1:].sum())
    assert trained > reference[0][1] > reference[-1][1]  # later steps (and non-draft argmaxes) have fewer
    assert total.item() == pytest.approx(sum(0.8**k * summed for k, (summed, _) in enumerate(reference)) / trained, rel=1e-5)
    f.loss_denominator = 2.5  # what the trainer sets: the global batch's trained positions per micro-batch
    assert draft.loss(f)[0].item() == pytest.approx(total.item() * trained / 2.5, rel=1e-5)


@pytest.mark.parametrize("block,num_layers", [(512, 1), (3, 1), (3, 2)])
def test_steps_run_only_where_trained_give_the_full_unrolls_loss_and_gradients(block, num_layers):
    """Steps 1.. run at the trained positions only (skip_untrained) or everywhere: the same loss, metrics and
    gradients, also through the checkpointed query blocks and in every layer of a multi-layer draft."""
    draft = tiny_draft(ttt_steps=4, num_layers=num_layers)
    draft.midlayer.self_attn.block = block
    f = random_features(draft, B=3, T=12)
    f.loss_mask[0, :] = 0  # a row with nothing trained: no position of it runs after step 0
    f.loss_mask[1, 5:9] = 0
    results = []
    nothing = Features(**{**vars(f), "loss_mask": torch.zeros_like(f.loss_mask)})  # no step trained anywhere
    loss, metrics = draft.loss(nothing)
    loss.backward()  # still one graph through every step (a rank with nothing to train keeps in step with the others)
    assert loss.item() == 0 and metrics["valid_tokens"] == 0
    assert all(p.grad is not None for n, p in draft.named_parameters() if p.requires_grad and n.startswith("midlayer"))
    for skip in (True, False):
        draft.skip_untrained = skip
        draft.zero_grad(set_to_none=True)
        loss, metrics = draft.loss(f)
        loss.backward()
        results.append((loss.detach(), metrics, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}))
    (l1, m1, g1), (l2, m2, g2) = results
    torch.testing.assert_close(l1, l2, atol=1e-6, rtol=1e-5)
    assert m1 == pytest.approx(m2, rel=1e-5, abs=1e-6)
    assert g1.keys() == g2.keys() and g1
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], atol=1e-6, rtol=1e-4, msg=name)


def test_loss_gradients_and_metrics():
    draft = tiny_draft(ttt_steps=3, draft_vocab=3)  # 3 draft tokens: chance accuracy ~1/3, so chains form
    assert isinstance(draft, DraftHead)
    f = random_features(draft)
    total, metrics = draft.loss(f)
    total.backward()
    assert draft.embed_tokens.weight.grad is None  # frozen target embedding
    assert draft.fc.weight.grad is not None and draft.fc.weight.grad.abs().sum() > 0
    for k in range(3):
        assert 0.0 <= metrics[f"acc_{k}"] <= 1.0 and 0.0 < metrics[f"accept_{k}"] <= 1.0
    # The simulated acceptance length by the one definition every head shares: the joint chain, position by
    # position (steps 0..k all right among the positions trained at every step 0..k), not a product of marginals.
    valid = torch.zeros_like(f.loss_mask, dtype=torch.bool)
    valid[:, :-1] = f.loss_mask[:, 1:].bool() & f.target_in_draft[:, :-1]
    chain = chain_valid = None
    expected_len = 1.0
    with torch.no_grad():
        for k, logits in enumerate(draft.unroll(f)):  # [B, T, V_d]
            valid_k = torch.zeros_like(valid)
            valid_k[:, : -(1 + k)] = valid[:, 1 + k:]
            right = torch.zeros_like(valid)
            right[:, : -(1 + k)] = logits[:, : -(1 + k)].argmax(-1) == f.target_logits[:, 1 + k:].argmax(-1)
            right &= valid_k
            chain, chain_valid = (right, valid_k) if chain is None else (chain & right, chain_valid & valid_k)
            expected_len += chain.sum().item() / max(chain_valid.sum().item(), 1)
            assert metrics[f"acc_{k}"] == pytest.approx(right.sum().item() / valid_k.sum().item())
    assert metrics["sim_accept_len"] == pytest.approx(expected_len)
    assert metrics["sim_accept_len"] != pytest.approx(
        1 + metrics["acc_0"] + metrics["acc_0"] * metrics["acc_1"] + metrics["acc_0"] * metrics["acc_1"] * metrics["acc_2"])


def test_draft_equal_to_target_has_full_accuracy_and_acceptance():
    draft = tiny_draft(ttt_steps=2)
    f = random_features(draft)
    with torch.no_grad():
        _, random_metrics = draft.loss(f)
    assert random_metrics["acc_0"] < 1.0
    # Uniform target and uniform draft: the same distribution, so both argmaxes are entry 0.
    f.target_logits = torch.zeros_like(f.target_logits)
    draft.lm_head.weight.data.zero_()
    _, m = draft.loss(f)
    assert m["acc_0"] == 1.0 and m["accept_0"] == pytest.approx(1.0) and m["sim_accept_len"] == pytest.approx(3.0)


def test_draft_vocab_ordering_padding_and_counts():
    counts = torch.tensor([0, 5, 5, 0, 9, 1, 0, 0])
    d2t, t2d = build_draft_vocab(counts, 4)
    used = torch.arange(4) + d2t
    assert used.tolist() == [1, 2, 4, 5]
    assert t2d.tolist() == [False, True, True, False, True, True, False, False]
    check_draft_vocab(d2t, t2d)
    # Fewer distinct tokens than V_d: padded with the smallest unused ids.
    d2t, t2d = build_draft_vocab(torch.tensor([0, 0, 3, 0, 0, 0]), 3)
    assert (torch.arange(3) + d2t).tolist() == [0, 1, 2]
    counts = count_tokens([([1, 2, 2, 3], [0, 1, 1, 0]), ([3, 3], [1, 1])], vocab_size=5)
    assert counts.tolist() == [0, 0, 2, 2, 0]
    with pytest.raises(ValueError, match="outside the target vocab"):
        count_tokens([([9], [1])], vocab_size=5)


def test_export_is_the_flat_server_layout(tmp_path):
    draft = tiny_draft()
    draft.save_pretrained(tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 48 and cfg["vocab_size"] == V and cfg["tie_word_embeddings"] is False
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert cfg["norm_before_residual"] is False
    tensors = load_file(str(tmp_path / "d" / "model.safetensors"))
    hd = cfg["head_dim"]
    expected = {
        "fc.weight": (H, 3 * H),
        "midlayer.self_attn.q_proj.weight": (cfg["num_attention_heads"] * hd, 2 * H),
        "midlayer.self_attn.k_proj.weight": (cfg["num_key_value_heads"] * hd, 2 * H),
        "midlayer.self_attn.v_proj.weight": (cfg["num_key_value_heads"] * hd, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, cfg["num_attention_heads"] * hd),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (64, H),
        "midlayer.mlp.up_proj.weight": (64, H),
        "midlayer.mlp.down_proj.weight": (H, 64),
        "norm.weight": (H,),
        "lm_head.weight": (48, H),
        "d2t": (48,),
        "t2d": (V,),
    }
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    # Round trip: an fp32 export reloads to exactly the same head; the default bf16 one to a close one.
    f = random_features(draft)
    expected = draft.loss(f)[0].item()
    draft.save_pretrained(tmp_path / "d32", dtype=torch.float32)
    exact = Eagle3Draft.from_pretrained(tmp_path / "d32", target_embeddings=draft.embed_tokens.weight, ttt_steps=4)
    assert torch.equal(exact.d2t, draft.d2t) and torch.equal(exact.t2d, draft.t2d)
    assert exact.loss(f)[0].item() == pytest.approx(expected, abs=1e-6)
    bf16 = Eagle3Draft.from_pretrained(tmp_path / "d", target_embeddings=draft.embed_tokens.weight, ttt_steps=4)
    assert bf16.loss(f)[0].item() == pytest.approx(expected, rel=0.05)
    with pytest.raises(ValueError, match="pass the target's embeddings"):
        Eagle3Draft.from_pretrained(tmp_path / "d")
    with pytest.raises(ValueError, match=r"trained for a target with vocab 128 and hidden size 32"):
        Eagle3Draft.from_pretrained(tmp_path / "d", target_embeddings=torch.zeros(100, 32))


def test_config_that_does_not_fit_the_target():
    target = tiny_causal_lm("llama", num_hidden_layers=8)
    other = tiny_causal_lm("llama", num_hidden_layers=4, hidden_size=48, vocab_size=100)
    config = Eagle3Config.from_target(target.config, draft_vocab_size=48)
    config.check_target(target.config)
    with pytest.raises(ValueError) as err:
        config.check_target(other.config)
    text = str(err.value)
    assert "target_hidden_size 32 != target hidden_size 48" in text
    assert "vocab_size 128 != target vocab_size 100" in text
    assert "out of range" in text



def test_a_target_with_rope_per_layer_type_gives_the_draft_its_full_attention_rope():
    """Gemma 3 keeps one rope per layer type (sliding 1e4, full 1e6); the draft's one layer attends over the whole
    context, so it takes the full-attention rope, as a plain default rope (no per-type dict in its config)."""
    target = tiny_causal_lm("gemma3_text", num_hidden_layers=8)
    params = target.config.rope_parameters
    assert set(params) == {"sliding_attention", "full_attention"}
    config = Eagle3Config.from_target(target.config, draft_vocab_size=48)
    assert config.rope_theta == params["full_attention"]["rope_theta"] != params["sliding_attention"]["rope_theta"]
    assert config.rope_scaling is None and config.to_hf_dict()["rope_scaling"] is None


def test_steps_that_are_not_logged_skip_top5_and_accept_and_train_the_same():
    """``Features.full_metrics=False`` (a step the trainer does not log) leaves out top-5 and sum min(p, q) -- each a
    pass over the logits -- and changes nothing else: the loss and gradients bit for bit, acc_k, sim_accept_len."""
    draft = tiny_draft()
    f = random_features(draft)
    metrics, grads = [], []
    for full in (True, False):
        draft.zero_grad()
        loss, m = draft.loss(dataclasses.replace(f, full_metrics=full))
        loss.backward()
        metrics.append({**m, "loss": float(loss)})
        grads.append({n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None})
    full, light = metrics
    assert light["loss"] == full["loss"] and light["sim_accept_len"] == full["sim_accept_len"]
    for n, g in grads[0].items():
        assert torch.equal(g, grads[1][n]), n
    for k in range(draft.ttt_steps):
        assert light[f"acc_{k}"] == full[f"acc_{k}"]
        assert full[f"acc_{k}"] <= full[f"top5_{k}"] <= 1.0 and 0.0 < full[f"accept_{k}"] <= 1.0
        assert f"top5_{k}" not in light and f"accept_{k}" not in light
