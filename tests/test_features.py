"""The offline pipeline: feature generation, the store's safety, and training from stored features."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainer_fixtures import make_setup

from headstart.trainer.batches import collate
from headstart.trainer.config import load_config
from headstart.trainer.feature_store import CorruptShardError, FeatureStore
from headstart.scripts import generate_features
from headstart.trainer.run import build_trainer

REPO = Path(__file__).resolve().parents[1]

BF16 = ["--target.dtype=bfloat16", "--features.aux=bf16", "--features.target_dist=hidden"]


def setup(root: Path, *extra: str, head: str = "eagle3") -> list[str]:
    return make_setup(root, head=head) + ["--features.samples_per_shard=5", "--features.batch_size=1", "--train.batch_size=1",
                               "--train.max_steps=1", *extra]


def generate(overrides: list[str], store: Path, resume: bool = False) -> dict:
    return generate_features.generate(load_config(None, [*overrides, f"--features.path={store}"]), resume=resume)


def trainers(overrides: list[str], store: Path, root: Path):
    online = build_trainer(load_config(None, [*overrides, f"--output_dir={root / 'online'}"]))
    offline = build_trainer(load_config(None, [*overrides, f"--output_dir={root / 'offline'}", f"--features.path={store}"]))
    return online, offline


def test_bf16_store_feeds_the_head_exactly_what_the_target_does(tmp_path):
    overrides = setup(tmp_path, *BF16)
    manifest = generate(overrides, tmp_path / "store")
    assert manifest["num_samples"] == 24 and len(manifest["shards"]) == 5  # ceil(24 / 5)
    online, offline = trainers(overrides, tmp_path / "store", tmp_path)
    for rows in ([0], [3], [17]):
        batch = collate(online.train_data, rows)
        a, b = online.features(batch), offline.features(batch)
        assert a.aux_hidden_states.dtype == b.aux_hidden_states.dtype == torch.bfloat16
        for name in ("input_ids", "loss_mask", "aux_hidden_states", "target_logits", "target_in_draft"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    loss_online = online.train_step()["loss"]
    loss_offline = offline.train_step()["loss"]
    assert loss_offline == pytest.approx(loss_online, abs=1e-6)


def test_medusa_stores_only_the_final_hidden_state_and_bf16_equals_online(tmp_path):
    overrides = setup(tmp_path, "--target.dtype=bfloat16", "--draft.num_heads=3", head="medusa")
    manifest = generate(overrides, tmp_path / "store")
    assert manifest["storage"] == {"aux": None, "hidden": "bf16", "topk": None}
    shard = FeatureStore(tmp_path / "store").get(0)
    assert set(shard) == {"input_ids", "loss_mask", "hidden"}  # nothing the heads do not read
    H, n = manifest["hidden_size"], manifest["num_tokens"]
    assert 0 < manifest["bytes"] - (2 * H + 4 + 1) * n < 1000 * len(manifest["shards"])  # 2H+5 bytes/token
    online, offline = trainers(overrides, tmp_path / "store", tmp_path)
    for rows in ([0], [3], [17]):
        batch = collate(online.train_data, rows)
        a, b = online.features(batch), offline.features(batch)
        assert a.aux_hidden_states is b.aux_hidden_states is None and a.target_logits is b.target_logits is None
        for name in ("input_ids", "loss_mask", "last_hidden_state"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert offline.train_step()["loss"] == pytest.approx(online.train_step()["loss"], abs=1e-6)


def test_fp8_final_hidden_states_are_half_the_bytes_and_close(tmp_path):
    overrides = setup(tmp_path, "--features.hidden=fp8", head="medusa")
    manifest = generate(overrides, tmp_path / "store")
    H, n = manifest["hidden_size"], manifest["num_tokens"]
    assert 0 < manifest["bytes"] - (H + 2 + 4 + 1) * n < 1000 * len(manifest["shards"])  # fp8 + bf16 scale: H+7
    online, offline = trainers(overrides, tmp_path / "store", tmp_path)
    batch = collate(online.train_data, [0, 1])
    valid = batch["attention_mask"].bool()
    a, b = online.features(batch).last_hidden_state[valid], offline.features(batch).last_hidden_state[valid]
    assert 0 < ((a - b).norm() / a.norm()) < 0.05
    # A store made for Medusa lacks what EAGLE-3 reads: refused by name, not trained on zeros.
    with pytest.raises(ValueError, match="hold no aux hidden states"):
        build_trainer(load_config(None, [*setup(tmp_path), f"--output_dir={tmp_path / 'e'}",
                                         f"--features.path={tmp_path / 'store'}"]))


def test_default_store_is_at_most_half_of_specforge_and_trains_close_to_online(tmp_path):
    overrides = setup(tmp_path)  # fp8 aux + top-32 probabilities
    manifest = generate(overrides, tmp_path / "store")
    H, k, n = manifest["hidden_size"], 32, manifest["num_tokens"]
    per_token = lambda h: 3 * h + 3 * 2 + k * (4 + 2) + 4 + 1  # noqa: E731  fp8 aux, bf16 scales, top-k ids+probs, id, mask
    headers = manifest["bytes"] - per_token(H) * n  # safetensors JSON headers: a few hundred bytes per shard
    assert 0 < headers < 1000 * len(manifest["shards"])
    for h in (256, 4096, 8192):  # the demo target, Llama-3.1-8B, 70B: at most half of SpecForge's 8H+16
        assert per_token(h) <= (8 * h + 16) / 2
    online, offline = trainers(overrides, tmp_path / "store", tmp_path)
    batch = collate(online.train_data, [0, 1])
    a, b = online.features(batch), offline.features(batch)
    valid = batch["attention_mask"].bool()  # padding is not stored (and never trained)
    rel = (a.aux_hidden_states[valid] - b.aux_hidden_states[valid]).norm() / a.aux_hidden_states[valid].norm()
    assert 0 < rel < 0.05  # fp8 e4m3 with per-token scales: a few percent, not exact
    # The teacher is computed where the next token is trained (trainer/features.py teacher_at_labels): compare there.
    labelled = torch.zeros_like(valid)
    labelled[:, :-1] = batch["loss_mask"][:, 1:].bool()
    assert labelled.any() and torch.equal(a.target_in_draft[labelled], b.target_in_draft[labelled])
    # Top-k keeps the target's argmax on the draft vocab wherever the head is trained on that position.
    trained = labelled & a.target_in_draft
    assert torch.equal(a.target_logits.argmax(-1)[trained], b.target_logits.argmax(-1)[trained])
    # (The loss value itself differs: a random tiny target is nearly uniform, far from its top-32.
    # BENCHMARKS.md compares tau of heads trained online and offline on the demo target.)
    assert torch.isfinite(torch.tensor(offline.train_step()["loss"]))


def test_a_killed_job_resumes_and_skips_finished_shards(tmp_path, monkeypatch):
    overrides, store = setup(tmp_path), tmp_path / "store"
    first = generate(overrides, store)
    victim = first["shards"][2]["file"]
    (store / victim).unlink()  # as if killed while writing shard 2: no shard, no sidecar, no manifest
    (store / victim.replace(".safetensors", ".json")).unlink()
    (store / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        FeatureStore(store)
    written = []
    original = generate_features.write_shard
    monkeypatch.setattr(generate_features, "write_shard", lambda d, name, *a: written.append(name) or original(d, name, *a))
    again = generate(overrides, store, resume=True)
    assert written == [victim.removesuffix(".safetensors")]
    assert [s["crc32"] for s in again["shards"]] == [s["crc32"] for s in first["shards"]]  # deterministic


def test_a_restart_with_other_settings_is_refused(tmp_path):
    overrides, store = setup(tmp_path), tmp_path / "store"
    generate(overrides, store)
    with pytest.raises(ValueError, match="resume it with the same settings"):
        generate(overrides + ["--features.topk=8"], store, resume=True)
    with pytest.raises(ValueError, match=f"{store} already holds a feature job .*--resume.*--overwrite"):
        generate(overrides, store)  # neither: refused before anything is touched


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_shard_is_named_and_never_read(tmp_path, damage):
    overrides, store = setup(tmp_path), tmp_path / "store"
    manifest = generate(overrides, store)
    shard = store / manifest["shards"][1]["file"]
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[:-100]
    shard.write_bytes(bytes(data))
    features = FeatureStore(store)
    row = manifest["shards"][1]["rows"][0]
    with pytest.raises(CorruptShardError, match=shard.name):
        features.get(row)
    features.get(manifest["shards"][0]["rows"][0])  # the intact shards still read


def test_training_stops_on_a_corrupt_shard_before_the_step_and_a_resumed_job_rebuilds_exactly_it(tmp_path, capsys):
    overrides, store = setup(tmp_path, "--train.batch_size=4", "--train.max_steps=2"), tmp_path / "store"
    manifest = generate(overrides, store)
    offline = build_trainer(load_config(None, [*overrides, f"--output_dir={tmp_path / 'run'}", f"--features.path={store}"]))
    step0_rows = set(offline.train_data.select(offline.plan.rows(0, 0))["row"])  # dataset rows: the store's keys
    victim = next(s for s in manifest["shards"] if step0_rows & set(s["rows"]))["file"]
    data = bytearray((store / victim).read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the crc32 finds it
    (store / victim).write_bytes(bytes(data))
    before = {k: v.clone() for k, v in offline.backend.module.state_dict().items()}
    with pytest.raises(CorruptShardError, match=f"step 1 cannot read its features: feature shard .*{victim} is corrupt"
                                                ".*generate_features.py again with the same recipe.*--resume"):
        offline.train()
    assert offline.step == 0 and all(torch.equal(v, offline.backend.module.state_dict()[k]) for k, v in before.items())
    capsys.readouterr()
    again = generate(overrides, store, resume=True)
    out = capsys.readouterr().out
    assert f"rebuilt {victim.removesuffix('.safetensors')}," in out and out.count("rebuilt") == 1
    assert [s["crc32"] for s in again["shards"]] == [s["crc32"] for s in manifest["shards"]]
    resumed = build_trainer(load_config(None, [*overrides, f"--output_dir={tmp_path / 'run'}", f"--features.path={store}"]))
    resumed.train(resume=True)
    assert resumed.step == 2


def test_features_of_another_target_or_layers_are_refused(tmp_path):
    overrides, store = setup(tmp_path), tmp_path / "store"
    generate(overrides, store)
    with pytest.raises(ValueError, match="another aux layer ids"):
        build_trainer(load_config(None, overrides + [f"--features.path={store}", "--target.aux_layer_ids=[1,3,5]"]))
    with pytest.raises(ValueError, match="another target dtype"):
        build_trainer(load_config(None, overrides + [f"--features.path={store}", "--target.dtype=bfloat16"]))
    config = json.loads((tmp_path / "target" / "config.json").read_text())
    (tmp_path / "target" / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    with pytest.raises(ValueError, match="another target config"):
        build_trainer(load_config(None, overrides + [f"--features.path={store}"]))


def test_the_store_opens_shards_lazily(tmp_path, monkeypatch):
    overrides, store = setup(tmp_path), tmp_path / "store"
    generate(overrides, store)
    import headstart.trainer.feature_store as fs

    opened = []
    original = fs.safe_open
    monkeypatch.setattr(fs, "safe_open", lambda path, **kw: opened.append(path) or original(path, **kw))
    features = FeatureStore(store)
    assert opened == []
    features.get(7)
    features.get(7)
    assert len(opened) == 1


def test_two_ranks_write_one_store_equal_to_a_single_process_one(tmp_path):
    overrides = setup(tmp_path)
    single = generate(overrides, tmp_path / "single")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "scripts" / "generate_features.py"), *overrides, f"--features.path={tmp_path / 'two'}"]
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bytes/token" in result.stdout
    a, b = FeatureStore(tmp_path / "single"), FeatureStore(tmp_path / "two")
    assert {s["file"][:10] for s in b.manifest["shards"]} == {"shard-r000", "shard-r001"}
    assert b.manifest["num_tokens"] == single["num_tokens"]
    from headstart.trainer.feature_store import dequantize_fp8

    for row in range(24):
        x, y = a.get(row), b.get(row)
        assert set(x) == set(y)
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        # Same values up to float rounding (one process may use other thread counts than the other).
        ax, ay = (dequantize_fp8(s["aux"], s["aux_scale"], torch.float32) for s in (x, y))
        assert torch.allclose(ax, ay, rtol=0.07, atol=1e-3)
        assert (x["topk_ids"][:, 0] == y["topk_ids"][:, 0]).float().mean() > 0.95


def feature_job(overrides: list[str], cwd: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "scripts" / "generate_features.py"), *overrides, *extra]
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)  # a hang fails fast
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow  # three 2-rank jobs, ~20 s each
def test_a_target_sharded_over_the_ranks_stores_the_same_features(tmp_path):
    """parallel.shard_target in the feature job (a target larger than one GPU): every forward gathers the layers from
    both ranks, so a rank with fewer rows (23 rows: 12 and 11) or with its shards already done (a resumed job) runs
    the forwards it owes; the shards are the replicated target's, byte for byte."""
    overrides = make_setup(tmp_path, rows=23) + ["--features.samples_per_shard=5", "--features.batch_size=1"]
    feature_job(overrides, tmp_path, f"--features.path={tmp_path / 'replicated'}")
    sharded = tmp_path / "sharded"
    feature_job(overrides, tmp_path, f"--features.path={sharded}", "--parallel.shard_target=true")
    files = sorted(p.name for p in (tmp_path / "replicated").glob("shard-*.safetensors"))
    assert len(files) == 6 and files == sorted(p.name for p in sharded.glob("shard-*.safetensors"))
    for name in files:
        assert (sharded / name).read_bytes() == (tmp_path / "replicated" / name).read_bytes(), name
    for lost in sharded.glob("shard-r001-*"):  # rank 1's work lost: rank 0 has nothing left but the forwards it owes
        lost.unlink()
    result = feature_job(overrides, tmp_path, f"--features.path={sharded}", "--parallel.shard_target=true", "--resume")
    assert "skipped 3 finished shard(s) of rank 0" in result.stdout
    for name in files:
        assert (sharded / name).read_bytes() == (tmp_path / "replicated" / name).read_bytes(), name
