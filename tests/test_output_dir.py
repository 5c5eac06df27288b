"""A run, feature job or regeneration job is never started over finished work by accident, and a
user error under torchrun is printed once, as the last thing on the screen."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_fixtures import make_setup, train_losses

from headstart.trainer.output_dir import JOB_PLAN, claim_output_dir

REPO = Path(__file__).resolve().parents[1]


def script(name: str):
    return importlib.import_module(f"headstart.scripts.{name}")


def test_claim_refuses_moves_aside_or_continues(tmp_path):
    out = tmp_path / "job"
    assert claim_output_dir(out, JOB_PLAN, "feature job", resume=False, overwrite=False) is None  # nothing there yet
    out.mkdir()
    (out / "plan.json").write_text("{}")
    (out / "shard-0.safetensors").write_text("finished work")
    with pytest.raises(ValueError, match=rf"{out} already holds a feature job \(plan.json\). Pass --resume .* --overwrite"):
        claim_output_dir(out, JOB_PLAN, "feature job", resume=False, overwrite=False)
    assert claim_output_dir(out, JOB_PLAN, "feature job", resume=True, overwrite=False) is None
    with pytest.raises(ValueError, match="pass one"):
        claim_output_dir(out, JOB_PLAN, "feature job", resume=True, overwrite=True)
    first = claim_output_dir(out, JOB_PLAN, "feature job", resume=False, overwrite=True)
    assert not out.exists() and (first / "shard-0.safetensors").read_text() == "finished work"  # moved, not deleted
    out.mkdir()
    (out / "plan.json").write_text("{}")
    second = claim_output_dir(out, JOB_PLAN, "feature job", resume=False, overwrite=True)
    assert second != first and second.name.startswith("job.old-") and first.exists()


def test_training_into_a_finished_run_is_refused_unless_resumed_or_overwritten(tmp_path, capsys):
    train = script("train_eagle3")
    overrides = make_setup(tmp_path) + ["--train.max_steps=2", "--train.save_every=1"]
    assert train.main(overrides) == 0
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    last = capsys.readouterr().out.strip().splitlines()[-2:]  # the main job ends naming its head and what to run next
    final = json.loads(metrics.strip().splitlines()[-1])
    assert last[0] == (f"done. The trained head is in {tmp_path / 'run' / 'final'}: simulated acceptance length "
                       f"{final['sim_accept_len']:.3f}.")
    assert last[1].startswith(f"Next: headstart check --head {tmp_path / 'run' / 'final'} --target ")
    assert train.main(overrides) == 2
    err = capsys.readouterr().err
    assert f"error: {tmp_path / 'run'} already holds a training run (checkpoints, metrics.jsonl, final)" in err
    assert "--resume" in err and "--overwrite" in err
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics  # untouched
    assert train.main(overrides + ["--resume"]) == 0  # nothing left to train: the finished run stays as it was
    assert len(train_losses(tmp_path / "run" / "metrics.jsonl")) == 2
    assert train.main(overrides + ["--overwrite"]) == 0
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(aside) == 1 and (aside[0] / "metrics.jsonl").read_text() == metrics
    assert len(train_losses(tmp_path / "run" / "metrics.jsonl")) == 2  # a fresh run, one record per step


def test_an_error_under_torchrun_is_printed_once_and_last(tmp_path):
    overrides = make_setup(tmp_path, rows=4, layers=2)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"step": 1, "split": "train", "loss": 1.0}) + "\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "scripts" / "train_eagle3.py"), *overrides]
    result = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert output.count("already holds a training run") == 1, output[-3000:]
    last = [line for line in result.stderr.splitlines() if line.strip() and not set(line.strip()) <= {"="}][-1]
    assert "error: " in last and "already holds a training run" in last, result.stderr[-2000:]


def test_the_headstart_launcher_prints_a_refusal_alone(tmp_path):
    """``headstart train --nproc-per-node 2`` launches the ranks itself: the refusal is its only output, exit 2."""
    overrides = make_setup(tmp_path, rows=4, layers=2)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"step": 1, "split": "train", "loss": 1.0}) + "\n")
    cmd = [sys.executable, "-m", "headstart.scripts.cli", "train", "--nproc-per-node", "2", *overrides]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stdout == ""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "already holds a training run" in lines[0], result.stderr
