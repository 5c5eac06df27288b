"""The committed demo EAGLE-3 head loads against the demo target and really predicts it."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from headstart.heads.eagle3.module import Eagle3Draft
from headstart.models.target import Target, TargetConfig, load_tokenizer
from headstart.trainer.batches import collate
from headstart.trainer.data import DataConfig, build_dataset
from headstart.trainer.features import OnlineFeatures

REPO = Path(__file__).resolve().parents[1]
HEAD = REPO / "configs" / "demo" / "eagle3-head"
TARGET = REPO / "configs" / "demo" / "target"


def test_demo_head_fits_the_demo_target_and_beats_chance(tmp_path):
    target = Target.from_pretrained(TargetConfig(path=str(TARGET), dtype="float32"))
    head = Eagle3Draft.from_pretrained(HEAD, target_embeddings=target.embed_tokens.weight)
    head.config.check_target(target.config)
    assert head.config.aux_layer_ids == target.aux_layer_ids
    # A few real conversations, featurised exactly as in training.
    rows = [json.loads(line) for line in (REPO / "configs/demo/data/gsm8k_train.jsonl").read_text().splitlines()[:8]]
    data = tmp_path / "gsm8k8.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    ds, _ = build_dataset(DataConfig(files=(str(data),), max_length=256), load_tokenizer(str(TARGET)))
    features = OnlineFeatures(target, head.needs, head.target_vocab_ids())(collate(ds, list(range(8))))
    with torch.no_grad():
        _, metrics = head.loss(features)
    # An untrained head scores ~1/4096 here; the committed one must have learned the target.
    assert metrics["acc_0"] > 0.4 and metrics["acc_1"] > 0.3
    # Recomputed here from the head's own predictions, not read from its card: a chain longer than step 0 alone
    # (later steps accept too) and, since each later step is right less often than step 0, below 1 + K x acc_0.
    assert 1 + metrics["acc_0"] < metrics["sim_accept_len"] <= 1 + head.ttt_steps * metrics["acc_0"]
    assert metrics["sim_accept_len"] > 1.8


def _gsm8k_features(tmp_path, target, head, n: int = 8):
    rows = [json.loads(line) for line in (REPO / "configs/demo/data/gsm8k_train.jsonl").read_text().splitlines()[:n]]
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    ds, _ = build_dataset(DataConfig(files=(str(data),), max_length=256), load_tokenizer(str(TARGET)))
    return OnlineFeatures(target, head.needs, head.target_vocab_ids())(collate(ds, list(range(n))))


def test_demo_medusa_heads_beat_fresh_ones_and_fit_the_shipped_tree(tmp_path):
    from headstart.decode.tree import StaticTree
    from headstart.heads.medusa.module import MedusaConfig, MedusaHeads

    target = Target.from_pretrained(TargetConfig(path=str(TARGET), dtype="float32"))
    heads = MedusaHeads.load(REPO / "configs" / "demo" / "medusa-head", target)
    heads.set_teacher(target.vocab_head())
    fresh = MedusaHeads(MedusaConfig.from_target(target.config, heads.config.num_heads))
    fresh.load_target_lm_head(target.lm_head_weight)
    fresh.set_teacher(target.vocab_head())
    f = _gsm8k_features(tmp_path, target, heads)
    with torch.no_grad():
        trained, untrained = heads.loss(f)[1], fresh.loss(f)[1]
    # Fresh heads guess token t+1 for t+i+1 (a few percent); the committed ones learned the shift.
    assert trained["acc_0"] > untrained["acc_0"] + 0.2 and trained["acc_3"] > untrained["acc_3"] + 0.1
    tree = StaticTree(tuple(tuple(p) for p in json.loads((REPO / "configs/trees/medusa-demo-32.json").read_text())))
    assert len(tree.paths) == 32 and max(map(len, tree.paths)) <= heads.config.num_heads


def test_demo_mtp_layer_loads_in_headstarts_layout_and_beats_a_fresh_one(tmp_path):
    from headstart.heads.mtp.module import MTPHead, build_mtp

    target = Target.from_pretrained(TargetConfig(path=str(TARGET), dtype="float32"))
    head = MTPHead.load(REPO / "configs" / "demo" / "mtp-head", target)
    fresh = build_mtp(target, unroll=head.unroll_steps)  # the target's last layer behind untrained fusion weights
    f = _gsm8k_features(tmp_path, target, head)
    with torch.no_grad():
        trained, untrained = head.loss(f)[1], fresh.loss(f)[1]
    assert trained["acc_0"] > 0.4 and trained["acc_0"] > untrained["acc_0"] + 0.2
    assert trained[f"acc_{head.unroll_steps - 1}"] > 0.3  # the recurrent steps were trained too
