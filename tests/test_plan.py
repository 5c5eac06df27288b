"""headstart plan: exact parameter counts from meta-device builds, each recipe field moving the part it should, and
a clear verdict (and the field to change) when a step does not fit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from headstart.heads.registry import build_head
from headstart.models.head import FeatureNeeds
from headstart.models.target import Target, TargetConfig
from headstart.scripts import plan as plan_script
from headstart.trainer.config import load_config
from headstart.trainer.feature_store import Storage
from headstart.trainer.plan import GIB, plan

REPO = Path(__file__).resolve().parents[1]


def parts(result) -> dict[str, int]:
    return {name.split(" (")[0]: size for name, size in result.parts}


@pytest.mark.parametrize("recipe", ["eagle3", "peagle", "dflash", "medusa", "mtp"])
def test_parameter_counts_are_the_real_ones(recipe, monkeypatch):
    monkeypatch.chdir(REPO)
    config = load_config(f"configs/demo/{recipe}.yaml", [])
    result = plan(config, gpus=2)
    target = Target.from_pretrained(TargetConfig(path="configs/demo/target", dtype="float32"))
    head = build_head(config.draft, target, torch.ones(target.vocab_size))
    assert result.target_params == sum(p.numel() for p in target.model.parameters())
    assert result.head_params == sum(p.numel() for p in head.parameters() if p.requires_grad) > 0
    assert result.total == sum(size for _, size in result.parts) and result.fits is None


def test_recipe_fields_move_their_parts(monkeypatch):
    monkeypatch.chdir(REPO)
    recipe, gpu = "configs/llama3.1-8b/eagle3_online.yaml", "configs/llama3.1-8b"
    base = plan(load_config(recipe, []), gpus=8, gpu_memory_gib=80, target_config=gpu)
    assert 8.0e9 < base.target_params < 8.1e9 and base.fits
    assert base.tokens_per_micro_batch == 8192 and base.tokens_per_step == 8 * 8192
    b = parts(base)
    assert b["target weights"] == base.target_params * 2  # bfloat16
    sharded = parts(plan(load_config(recipe, ["--parallel.shard_target=true"]), gpus=8, target_config=gpu))
    assert sharded["target weights"] == b["target weights"] // 8
    half = plan(load_config(recipe, ["--data.tokens_per_batch=4096"]), gpus=8, target_config=gpu)
    assert parts(half)["head activations"] == b["head activations"] // 2
    offline = parts(plan(load_config("configs/llama3.1-8b/eagle3_offline.yaml", []), gpus=8, target_config=gpu))
    assert "target weights" not in offline and offline["target embedding and lm_head"] == 2 * 128256 * 4096 * 2
    one_gpu = plan(load_config(recipe, []), gpus=1, target_config=gpu)  # the head's states are not sharded
    assert parts(one_gpu)["head weights, gradients, optimizer states"] > b["head weights, gradients, optimizer states"]


def test_a_step_that_does_not_fit_names_what_to_change(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    argv = ["--config", "configs/llama3.1-8b/eagle3_online.yaml", "--target-config", "configs/llama3.1-8b",
            "--gpus", "8", "--gpu-memory", "24"]
    assert plan_script.main(argv) == 1
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "to fit: parallel.shard_target: true" in out
    assert "to fit: data.tokens_per_batch: halve it" in out
    assert plan_script.main(argv[:-1] + ["80"]) == 0 and "fits (" in capsys.readouterr().out


def test_a_missing_target_config_is_named(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert plan_script.main(["--config", "configs/llama3.1-8b/eagle3_online.yaml", "--gpus", "8"]) == 2
    assert "no config.json in /models/Llama-3.1-8B-Instruct: give the target's config with --target-config" in \
        capsys.readouterr().err


def test_store_bytes_per_token_match_what_is_written():
    needs = FeatureNeeds(aux_hidden_states=True, draft_vocab_logits=True)
    assert Storage.for_head(needs).bytes_per_token(4096, 3) == 3 * 4096 + 203
    hidden = FeatureNeeds(last_hidden_state=True)
    assert Storage.for_head(hidden).bytes_per_token(576, 3) == 2 * 576 + 5
    assert GIB == 2**30
