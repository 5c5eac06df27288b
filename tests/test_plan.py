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
    layer = 4096 * (2 * 4096 + 2 * 1024) + 3 * 4096 * 14336 + 2 * 4096  # Llama-3.1-8B: attention, MLP, norms
    assert sharded["target layers gathered"] == 2 * layer * 2 and "target layers gathered" not in b
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


def test_70b_recipes_fit_two_nodes_and_one_node_needs_the_target_sharded(monkeypatch, capsys):
    """configs/llama3.3-70b on 2 x 8 x 80 GB: all three fit; on 8 x 80 GB the online recipe still fits with the target
    sharded (twice its shard) and, replicated, does not: the advice names parallel.shard_target first."""
    monkeypatch.chdir(REPO)
    arch = "configs/llama3.3-70b"
    for recipe in ("eagle3_online", "eagle3_offline", "eagle3_deepspeed"):
        result = plan(load_config(f"{arch}/{recipe}.yaml", []), gpus=16, gpu_memory_gib=80, target_config=arch)
        assert 70.5e9 < result.target_params < 70.6e9 and result.fits, recipe
    online = f"{arch}/eagle3_online.yaml"
    two, one = (parts(plan(load_config(online, []), gpus=g, target_config=arch)) for g in (16, 8))
    assert one["target weights"] == 2 * two["target weights"] and one["target layers gathered"] > 3 * GIB
    assert plan(load_config(online, []), gpus=8, gpu_memory_gib=80, target_config=arch).fits
    argv = ["--config", online, "--target-config", arch, "--gpus", "8", "--gpu-memory", "80",
            "--parallel.shard_target=false"]
    assert plan_script.main(argv) == 1
    out = capsys.readouterr().out
    assert "does NOT fit" in out and out.index("to fit: parallel.shard_target: true") < out.index("GiB over")
