"""The committed demo EAGLE-3 head loads against the demo target and really predicts it."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from headstart.models.eagle3 import Eagle3Draft
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
    recorded = json.loads((HEAD / "eval_metrics.json").read_text())["evals"][-1]
    assert recorded["sim_accept_len"] > 1.5
