"""Sequence packing: several conversations per batch row, and every head's loss and gradients exactly those of
the padded batch on the same conversations, online (the target's packed forward) and offline (the store)."""

from __future__ import annotations

import pytest
import torch
from trainer_fixtures import make_setup

from headstart.heads.registry import HEADS
from headstart.models.head import Features, same_document, trained_positions
from headstart.models.ttt_attention import ttt_attention, ttt_attention_dense, ttt_attention_flex
from headstart.scripts import generate_features
from headstart.trainer.batches import collate, pack
from headstart.trainer.config import load_config
from headstart.trainer.run import build_trainer

ROWS = [0, 1, 2, 3, 4, 5, 6]


def test_first_fit_decreasing_places_every_sequence_once_within_capacity():
    lengths = [40, 7, 33, 20, 48, 5, 12]
    placement = pack(lengths, 60)
    assert placement == pack(lengths, 60)  # deterministic
    spans: dict[int, list[tuple[int, int]]] = {}
    for (b, start), n in zip(placement, lengths):
        spans.setdefault(b, []).append((start, start + n))
    for b, s in spans.items():
        s.sort()
        assert s[0][0] == 0 and all(a[1] == c[0] for a, c in zip(s, s[1:])), s  # back to back from 0
        assert s[-1][1] <= 60
    assert len(spans) == 3  # 165 tokens: 48+12 | 40+20 | 33+7+5
    assert pack([70, 10], 60) == [(0, 0), (1, 0)]  # longer than a row: a row of its own


def test_packed_batch_positions_restart_per_sequence_and_for_the_padding():
    class Rows:
        def __getitem__(self, rows):
            data = {"input_ids": [[1] * 5, [2] * 3, [3] * 6], "loss_mask": [[0, 1, 1, 1, 1], [0, 1, 1], [0] * 3 + [1] * 3]}
            return {k: [v[r] for r in rows] for k, v in data.items()}

    batch = collate(Rows(), [0, 1, 2], pack_tokens=9)
    assert batch["input_ids"].tolist() == [[3] * 6 + [2] * 3, [1] * 5 + [0] * 4]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 0, 1, 2], [0, 1, 2, 3, 4, 0, 1, 2, 3]]
    assert batch["segments"].tolist() == [[1, 0, 5], [0, 6, 3], [0, 0, 6]]
    assert batch["attention_mask"].sum() == 14
    # The trained positions are the same count as the padded batch's: no sequence's first token is one.
    assert trained_positions(batch["loss_mask"], batch["position_ids"]) == trained_positions(collate(Rows(), [0, 1, 2])["loss_mask"])
    assert same_document(batch["position_ids"], 2).tolist() == [[True] * 4 + [False] * 2 + [True, False, False],
                                                                [True] * 3 + [False] * 2 + [True, True, False, False]]


@pytest.mark.parametrize("block", [512, 4])
def test_ttt_attention_keeps_each_document_to_itself(block):
    """The packed TTT attention equals the TTT attention of each document alone (blocks and flex's mask)."""
    torch.manual_seed(0)
    lengths, steps, nh, hd = [5, 9, 3], 3, 2, 16
    T = sum(lengths)
    q = torch.randn(1, nh, T, hd, requires_grad=True)
    keys = [torch.randn(1, nh, T, hd) for _ in range(steps)]
    values = [torch.randn(1, nh, T, hd) for _ in range(steps)]
    documents = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    packed = ttt_attention(q, keys, values, block=block, documents=documents)
    start, alone = 0, []
    for n in lengths:
        at = slice(start, start + n)
        alone.append(ttt_attention_dense(q[:, :, at], [k[:, :, at] for k in keys], [v[:, :, at] for v in values]))
        start += n
    torch.testing.assert_close(packed, torch.cat(alone, dim=2), atol=1e-5, rtol=1e-5)
    flex = ttt_attention_flex(q.detach(), keys, values, compiled=False, documents=documents)
    torch.testing.assert_close(flex, packed.detach(), atol=1e-5, rtol=1e-5)


def _head_loss(head, f: Features) -> tuple[torch.Tensor, dict, dict[str, torch.Tensor]]:
    head.zero_grad(set_to_none=True)
    loss, metrics = head.loss(f)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}
    return loss.detach(), metrics, grads


@pytest.mark.parametrize("source", ["online", "offline"])
@pytest.mark.parametrize("head_name", sorted(HEADS))
def test_packed_loss_and_gradients_equal_the_padded_ones(tmp_path, head_name, source, monkeypatch):
    overrides = make_setup(tmp_path, head=head_name) + ["--target.dtype=float32", "--features.samples_per_shard=8"]
    if source == "offline":
        store = tmp_path / "store"
        generate_features.generate(load_config(None, [*overrides, f"--features.path={store}",
                                                      "--features.aux=bf16", "--features.target_dist=hidden"]))
        overrides += [f"--features.path={store}"]
    trainer = build_trainer(load_config(None, overrides))
    head = trainer.backend.module
    if head_name in ("eagle3", "peagle"):
        head.midlayer.self_attn.block = 16  # the checkpointed query blocks too, not only the one-block form
    elif head_name == "mtp":
        monkeypatch.setattr("headstart.heads.mtp.module.TTT_BLOCK", 16)
    padded = collate(trainer.train_data, ROWS)
    packed = collate(trainer.train_data, ROWS, pack_tokens=100)
    for batch in (padded, packed):  # every token trained (text rows): a sequence's first tokens are labels too
        batch["loss_mask"] = batch["attention_mask"].clone()
    assert packed["input_ids"].shape[0] < padded["input_ids"].shape[0]  # really several sequences per row
    f_pad, f_pack = trainer.features(padded), trainer.features(packed)
    # The target's (or the store's) features at each sequence's tokens are the padded batch's.
    for i, (b, start, n) in enumerate(packed["segments"].tolist()):
        for name in ("aux_hidden_states", "last_hidden_state", "target_logits"):
            a, c = getattr(f_pad, name), getattr(f_pack, name)
            m = n - 1 if name == "target_logits" else n  # the teacher exists where the next token is trained
            if a is not None:
                torch.testing.assert_close(c[b, start:start + m], a[i, :m], atol=1e-5, rtol=1e-5)
    loss_pad, m_pad, g_pad = _head_loss(head, f_pad)
    loss_pack, m_pack, g_pack = _head_loss(head, f_pack)
    torch.testing.assert_close(loss_pack, loss_pad, atol=1e-5, rtol=1e-5)
    sums = {k for k in m_pad if k.startswith("sum/")}
    assert sums and sums == {k for k in m_pack if k.startswith("sum/")}
    for k in sums:  # the same positions trained at every step, the same ones right
        if k.startswith(("sum/valid", "sum/correct", "sum/chain")):
            assert m_pack[k] == m_pad[k], k
    assert g_pad.keys() == g_pack.keys() and g_pad
    for name in g_pad:
        torch.testing.assert_close(g_pack[name], g_pad[name], atol=1e-5, rtol=1e-4, msg=name)
    if head_name == "mtp" and source == "online":  # MTP's other attention: the additive [B, T, (j+1)T] mask + SDPA
        head.block_attention = "sdpa"
        head.block.self_attn.config._attn_implementation = "sdpa"
        (l1, _, g1), (l2, _, g2) = _head_loss(head, f_pad), _head_loss(head, f_pack)
        torch.testing.assert_close(l2, l1, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(l1, loss_pad, atol=1e-5, rtol=1e-5)  # the same loss as the linear path's
        for name in g1:
            torch.testing.assert_close(g2[name], g1[name], atol=1e-5, rtol=1e-4, msg=name)


def test_a_packed_run_trains_and_counts_the_same_tokens(tmp_path):
    """``data.packing`` through the trainer: a step trains the same sequences and tokens as a padded one."""
    overrides = make_setup(tmp_path) + ["--target.dtype=float32", "--train.max_steps=2", "--train.batch_size=4"]
    padded = build_trainer(load_config(None, [*overrides, f"--output_dir={tmp_path / 'pad'}", "--data.packing=false"]))
    packed = build_trainer(load_config(None, [*overrides, f"--output_dir={tmp_path / 'pack'}", "--data.tokens_per_batch=96"]))
    assert packed.config.data.packing  # the default
    rows = packed.plan.rows(0, 0)
    assert "position_ids" in packed.batch(packed.train_data, rows) and "position_ids" not in padded.batch(padded.train_data, rows)
    assert packed.batch(packed.train_data, rows)["input_ids"].shape[0] == 2  # 4 sequences of ~40 tokens in rows of 96
    a, b = padded.train_step(), packed.train_step()
    assert a["tokens"] == b["tokens"] and a["valid_tokens"] == b["valid_tokens"]
    assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
    assert packed.train()["sim_accept_len"] >= 1.0
