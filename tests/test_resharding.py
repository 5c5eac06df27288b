"""A checkpoint written by N ranks resumes on M ranks: with the same global batch the resumed run
trains on the same rows, step for step, as an uninterrupted run, and ends with the same head."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file
from test_distributed import VARIANTS, needs, torchrun
from trainer_fixtures import make_setup, train_losses

pytestmark = pytest.mark.nightly
# Global batch 4 either way: 2 ranks x 1 sequence x 2 micro-batches, or 1 rank x 2 x 2.
SPLIT = {1: ["--train.batch_size=2", "--train.grad_accum=2"], 2: ["--train.batch_size=1", "--train.grad_accum=2"]}


def roll_back_to(run: Path, step: int) -> None:
    """What a kill right after the step-``step`` checkpoint leaves: later checkpoints, the final export and
    their metrics never happened (resume drops the metrics itself)."""
    root = run / "checkpoints"
    for later in root.glob("step_*"):
        if int(later.name.split("_")[1]) > step:
            shutil.rmtree(later)
    (root / "latest").write_text(f"step_{step:06d}")
    shutil.rmtree(run / "final")


@pytest.mark.parametrize("backend", ["fsdp", "zero2", "zero3"])
@pytest.mark.parametrize("ranks", [(2, 1), (1, 2)])
def test_a_run_resumes_on_another_world_size_as_if_uninterrupted(tmp_path, backend, ranks):
    needs(backend)
    before, after = ranks
    base = make_setup(tmp_path) + ["--train.max_steps=4", "--train.save_every=2", *VARIANTS[backend][:2]]
    torchrun(base + [f"--output_dir={tmp_path / 'whole'}", *SPLIT[before]], tmp_path, nproc=before)
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    roll_back_to(tmp_path / "resumed", 2)
    torchrun(base + [f"--output_dir={tmp_path / 'resumed'}", *SPLIT[after], "--resume"], tmp_path, nproc=after)

    whole, resumed = (train_losses(tmp_path / d / "metrics.jsonl") for d in ("whole", "resumed"))
    assert len(whole) == 4 and len(resumed) == 4 and whole[3] != whole[2]
    assert resumed == pytest.approx(whole, rel=1e-5, abs=1e-6)  # steps 3-4 on the other world size
    # The gradient itself (its norm before clipping), not only the loss: a wrong scale (1/W, 1/accum) shows here.
    norms = [[r["grad_norm"] for r in map(json.loads, (tmp_path / d / "metrics.jsonl").read_text().splitlines())
              if r["split"] == "train"] for d in ("whole", "resumed")]
    assert norms[1] == pytest.approx(norms[0], rel=1e-4) and norms[0][2] > 0
    state = json.loads((tmp_path / "resumed" / "checkpoints" / "step_000004" / "trainer_state.json").read_text())
    assert state["world_size"] == after and state["global_batch"] == 4 and state["rows_seen"] == 16
    a, b = (load_file(str(tmp_path / d / "final" / "model.safetensors")) for d in ("whole", "resumed"))
    assert set(a) == set(b)
    for name in a:  # bf16 exports: equal up to one rounding step
        assert (a[name].float() - b[name].float()).abs().max() <= 1e-2 * a[name].float().abs().max(), name


def test_another_global_batch_resumes_with_a_warning_and_no_row_twice(tmp_path):
    base = make_setup(tmp_path) + ["--train.max_steps=4", "--train.save_every=2"]
    torchrun(base + [f"--output_dir={tmp_path / 'run'}", *SPLIT[2]], tmp_path, nproc=2)
    roll_back_to(tmp_path / "run", 2)
    result = torchrun(base + [f"--output_dir={tmp_path / 'run'}", "--train.batch_size=3", "--resume"], tmp_path, nproc=1)
    assert "global batch of 4 sequences, this run has 3" in result.stderr
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_000004" / "trainer_state.json").read_text())
    assert state["rows_seen"] == 2 * 4 + 2 * 3 and state["global_batch"] == 3
