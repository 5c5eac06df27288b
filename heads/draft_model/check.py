"""The draft model's export detector and ``check_head`` rules: a plain causal LM, checked against the target's vocab."""

from __future__ import annotations

from pathlib import Path

from headstart.models.problem import Problem
from headstart.heads.draft_model.module import check_vocab


def detect_draft_model(directory: Path, config: dict) -> str | None:
    """A plain causal LM's config (every other head's config names a class of its own): a draft model's export."""
    arch = (config.get("architectures") or [""])[0]
    return "hf" if arch.endswith("ForCausalLM") and config.get("model_type") else None


def check_draft_model(directory: Path, layout: str, target_config) -> list[Problem]:
    """What a server would get wrong: a vocabulary other than the target's (its drafts would be other tokens), or
    weights that transformers cannot read as the config's model."""
    from transformers import AutoConfig

    where = str(Path(directory) / "config.json")
    problems = []
    try:
        check_vocab(AutoConfig.from_pretrained(str(directory)), target_config, where)
    except ValueError as err:
        problems.append(Problem(where, "vocab_size", str(err)))
    if not (Path(directory) / "model.safetensors").is_file() and not (Path(directory) / "model.safetensors.index.json").is_file():
        problems.append(Problem(str(directory), "model.safetensors", "no weights: expected model.safetensors"))
    return problems
