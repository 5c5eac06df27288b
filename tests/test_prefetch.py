"""``train.prefetch``: the next micro-batch's features computed on a worker thread while the head trains give the
same steps as computing them in turn, the worker is idle between steps, and a shard the worker could not read stops
the run at its own step with the usual error."""

from __future__ import annotations

import pytest
import torch
from trainer_fixtures import make_setup, train_losses

from headstart.scripts import generate_features
from headstart.trainer.config import load_config
from headstart.trainer.feature_store import CorruptShardError
from headstart.trainer.loop import prefetch_key
from headstart.trainer.run import build_trainer


def _steps(trainer, n: int) -> list[dict]:
    out = []
    for _ in range(n):
        out.append(trainer.train_step())
        trainer.step += 1
        if trainer.prefetch:  # idle between steps: evaluation and checkpoints have the target alone
            assert trainer.prefetch.pending is None or trainer.prefetch.pending[1].done()
    return out


@pytest.mark.parametrize("source", ["online", "offline"])
def test_prefetched_features_train_the_same_steps(tmp_path, source):
    overrides = make_setup(tmp_path) + ["--train.grad_accum=2", "--train.max_steps=3"]
    if source == "offline":
        store = tmp_path / "store"
        generate_features.generate(load_config(None, [*overrides, f"--features.path={store}", "--features.aux=bf16"]))
        overrides += [f"--features.path={store}"]
    plain = build_trainer(load_config(None, [*overrides, f"--output_dir={tmp_path / 'plain'}"]))
    ahead = build_trainer(load_config(None, [*overrides, f"--output_dir={tmp_path / 'ahead'}", "--train.prefetch=true"]))
    assert plain.prefetch is None and ahead.prefetch is not None
    served = []
    take = ahead.prefetch.take
    ahead.prefetch.take = lambda key: _record(served, take, key)
    collated = []
    batch = ahead.batch
    ahead.batch = lambda data, rows: collated.append(list(rows)) or batch(data, rows)
    a, b = _steps(plain, 3), _steps(ahead, 3)
    # Each of the 6 micro-batches collated once: the worker's is the one the step trains on (was 11 times).
    assert collated == [plain.plan.rows(s, m) for s in range(3) for m in range(2)]
    # Every micro-batch but the first came from the worker: (step, micro) 0,1 1,0 1,1 2,0 2,1.
    assert served == [prefetch_key(plain.batch(plain.train_data, plain.plan.rows(s, m)))
                      for s, m in ((0, 1), (1, 0), (1, 1), (2, 0), (2, 1))]
    for x, y in zip(a, b):
        assert y["loss"] == x["loss"] and y["grad_norm"] == x["grad_norm"] and y["tokens"] == x["tokens"]
    for (name, p), q in zip(plain.backend.module.named_parameters(), ahead.backend.module.parameters()):
        assert torch.equal(p, q), name


def _record(served: list, take, key):
    features = take(key)
    if features is not None:
        served.append(key)
    return features


def test_a_shard_the_worker_cannot_read_stops_the_run_at_its_own_step(tmp_path):
    overrides = make_setup(tmp_path) + ["--features.samples_per_shard=5", "--features.batch_size=1", "--train.batch_size=2",
                                        "--train.max_steps=3"]
    store = tmp_path / "store"
    manifest = generate_features.generate(load_config(None, [*overrides, f"--features.path={store}"]))
    trainer = build_trainer(load_config(None, [*overrides, f"--features.path={store}", "--train.prefetch=true"]))
    step0 = set(trainer.train_data.select(trainer.plan.rows(0, 0))["row"])
    step1 = set(trainer.train_data.select(trainer.plan.rows(1, 0))["row"])
    victim = next(s for s in manifest["shards"] if step1 & set(s["rows"]) and not step0 & set(s["rows"]))["file"]
    data = bytearray((store / victim).read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the crc32 finds it
    (store / victim).write_bytes(bytes(data))
    _steps(trainer, 1)  # the worker tried step 2's features meanwhile, and failed
    key, future = trainer.prefetch.pending
    assert key == prefetch_key(trainer.batch(trainer.train_data, trainer.plan.rows(1, 0)))
    assert isinstance(future.exception(), CorruptShardError)
    before = {k: v.clone() for k, v in trainer.backend.module.state_dict().items()}
    with pytest.raises(CorruptShardError, match=f"step 2 cannot read its features: feature shard .*{victim} is corrupt"):
        trainer.train_step()
    assert all(torch.equal(v, trainer.backend.module.state_dict()[k]) for k, v in before.items())


def test_any_other_worker_error_is_raised_by_the_step_that_needs_its_features(tmp_path):
    trainer = build_trainer(load_config(None, make_setup(tmp_path) + ["--train.prefetch=true"]))
    calls = []

    class SecondCallFails:  # the trainer's features, but the second call (the worker's: step 2's) fails
        def __init__(self, features):
            self.features = features

        def __getattr__(self, name):
            return getattr(self.features, name)

        def __call__(self, batch):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("out of memory (a stand-in)")
            return self.features(batch)

    trainer.features = SecondCallFails(trainer.features)
    _steps(trainer, 1)
    with pytest.raises(RuntimeError, match="out of memory"):
        trainer.train_step()
    assert len(calls) == 2  # raised where taken, not recomputed on the training thread


def test_a_run_with_evaluations_and_checkpoints_trains_the_same_with_prefetch(tmp_path):
    overrides = make_setup(tmp_path) + ["--train.max_steps=4", "--train.save_every=2", "--train.eval_every=1"]
    runs = {}
    for on in (False, True):
        out = tmp_path / f"run-{on}"
        trainer = build_trainer(load_config(None, [*overrides, f"--output_dir={out}", f"--train.prefetch={str(on).lower()}"]))
        runs[on] = (trainer.train(), train_losses(out / "metrics.jsonl"))
        if on:
            assert trainer.prefetch.pending is None  # dropped before the last evaluation and checkpoint
    assert runs[True][1] == runs[False][1] and len(runs[True][1]) == 4
    assert runs[True][0]["loss"] == runs[False][0]["loss"]
