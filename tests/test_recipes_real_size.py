"""The real-size recipes (configs/llama3.1-8b/, configs/qwen3-8b/, configs/llama3.3-70b/) run as written on a tiny
random model of the same architecture: built from the committed config.json with only the sizes made small, then each
recipe trains two steps with only sizes, paths and the device overridden (online, offline through the feature store,
DeepSpeed). The 70B recipes shard the target over the ranks: that runs on 2 ranks (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import LLAMA3_TEMPLATE, QWEN25_TEMPLATE, make_tokenizer
from safetensors.torch import load_file
from test_distributed import needs, torchrun
from trainer_fixtures import ANSWERS, QUESTIONS, train_losses
from transformers import AutoConfig, AutoModelForCausalLM

from headstart.scripts.generate_features import generate
from headstart.trainer.config import load_config
from headstart.trainer.run import build_trainer

REPO = Path(__file__).resolve().parents[1]
TARGETS = {"llama3.1-8b": (LLAMA3_TEMPLATE, "<|eot_id|>"), "qwen3-8b": (QWEN25_TEMPLATE, "<|im_end|>"),
           "llama3.3-70b": (LLAMA3_TEMPLATE, "<|eot_id|>")}
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, max_position_embeddings=256)


def tiny_target(name: str, root: Path) -> Path:
    """The committed architecture (config.json) at toy sizes, with a chat tokenizer of the target's template family."""
    config = json.loads((REPO / "configs" / name / "config.json").read_text())
    template, eos = TARGETS[name]
    tokenizer = make_tokenizer(template, eos)
    small = {**config, **SMALL, "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
             "eos_token_id": tokenizer.eos_token_id}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**small))
    assert type(model).__name__ == config["architectures"][0]
    out = root / "target"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def tiny_data(root: Path, rows: int = 16) -> Path:
    path = root / "chat.jsonl"
    with path.open("w") as f:
        for i in range(rows):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"{QUESTIONS[i % 6]} ({i})"},
                                             {"role": "assistant", "content": ANSWERS[i % 6]}]}) + "\n")
    return path


def sizes(root: Path, target: Path) -> list[str]:
    return [f"--output_dir={root / 'run'}", f"--target.path={target}", "--target.device=cpu", "--target.dtype=float32",
            f"--data.files=[{tiny_data(root)}]", "--data.max_length=128", "--data.tokens_per_batch=256",
            "--data.num_proc=1", f"--data.cache_dir={root / 'cache'}", "--draft.draft_vocab_size=64",
            "--train.max_steps=2", "--train.batch_size=2", "--train.eval_every=2", "--train.eval_fraction=0.2",
            "--train.max_eval_batches=1", "--train.log_every=1", "--logging.progress=false"]


def check_run(run: Path, architecture: str) -> None:
    losses = train_losses(run / "metrics.jsonl")
    assert len(losses) == 2 and all(loss > 0 for loss in losses)
    config = json.loads((run / "final" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 64
    assert json.loads((run / "final" / "headstart.json").read_text())["target"]["architectures"] == [architecture]
    assert load_file(str(run / "final" / "model.safetensors"))["d2t"].numel() == 64


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_online_recipe_trains_two_steps(tmp_path, monkeypatch, name):
    monkeypatch.chdir(REPO)
    recipe = load_config(str(REPO / "configs" / name / "eagle3_online.yaml"), sizes(tmp_path, tiny_target(name, tmp_path)))
    assert (recipe.train.lr, recipe.draft.options.ttt_steps, recipe.data.max_length) == (1e-4, 7, 128)
    build_trainer(recipe).train()
    check_run(tmp_path / "run", json.loads((REPO / "configs" / name / "config.json").read_text())["architectures"][0])


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_offline_recipe_stores_features_then_trains_two_steps(tmp_path, monkeypatch, name):
    monkeypatch.chdir(REPO)
    overrides = sizes(tmp_path, tiny_target(name, tmp_path)) + [f"--features.path={tmp_path / 'features'}"]
    recipe_path = str(REPO / "configs" / name / "eagle3_offline.yaml")
    generate(load_config(recipe_path, overrides))
    assert (tmp_path / "features" / "manifest.json").is_file()
    recipe = load_config(recipe_path, overrides)
    assert recipe.features.path == str(tmp_path / "features")
    build_trainer(recipe).train()
    check_run(tmp_path / "run", json.loads((REPO / "configs" / name / "config.json").read_text())["architectures"][0])


@pytest.mark.slow  # a torchrun process with DeepSpeed's start-up: ~40 s each
@pytest.mark.parametrize("name", sorted(TARGETS))
def test_deepspeed_recipe_trains_two_steps(tmp_path, monkeypatch, name):
    needs("zero2")
    recipe_path = str(REPO / "configs" / name / "eagle3_deepspeed.yaml")
    overrides = sizes(tmp_path, tiny_target(name, tmp_path))
    recipe = load_config(recipe_path, overrides)
    overrides.append(f"--parallel.deepspeed_config={REPO / recipe.parallel.deepspeed_config}")  # the recipe's own
    if recipe.features.path is not None:  # trains from the store its offline sibling writes (70B: ZeRO-3, offline)
        monkeypatch.chdir(REPO)
        overrides.append(f"--features.path={tmp_path / 'features'}")
        generate(load_config(recipe_path, overrides))
    torchrun(["--config", recipe_path, *overrides], cwd=tmp_path, nproc=1)
    check_run(tmp_path / "run", json.loads((REPO / "configs" / name / "config.json").read_text())["architectures"][0])


@pytest.mark.slow  # two 2-rank torchrun jobs: ~1 min
def test_70b_recipes_shard_the_target_over_two_ranks(tmp_path):
    """The 70B recipes as they run on 16 GPUs, on 2 ranks: online with the target's layers sharded (each forward
    gathers them), and the offline feature job with the same sharding; both the recipes' own parallel settings."""
    online, offline = (REPO / "configs" / "llama3.3-70b" / f"eagle3_{m}.yaml" for m in ("online", "offline"))
    assert load_config(str(online), []).parallel.shard_target and load_config(str(offline), []).parallel.shard_target
    overrides = sizes(tmp_path, tiny_target("llama3.3-70b", tmp_path))
    torchrun(["--config", str(online), *overrides], cwd=tmp_path, nproc=2)
    check_run(tmp_path / "run", "LlamaForCausalLM")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "scripts" / "generate_features.py"), "--config", str(offline), *overrides,
           f"--features.path={tmp_path / 'features'}"]
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = json.loads((tmp_path / "features" / "manifest.json").read_text())
    assert manifest["num_samples"] == 16 and {s["file"][:10] for s in manifest["shards"]} == {"shard-r000", "shard-r001"}
