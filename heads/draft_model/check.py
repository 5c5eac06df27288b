"""The draft model's export detector and ``check_head`` rules: a plain causal LM, checked against the target's vocab."""

from __future__ import annotations

from pathlib import Path

from headstart.models.problem import Problem
from headstart.models.target import text_config


def detect_draft_model(directory: Path, config: dict) -> str | None:
    """A plain causal LM's config (every other head's config names a class of its own): a draft model's export."""
    arch = (config.get("architectures") or [""])[0]
    return "hf" if arch.endswith("ForCausalLM") and config.get("model_type") else None


def check_draft_model(directory: Path, layout: str, target_config) -> list[Problem]:
    """What a server would get wrong: a vocabulary other than the target's (its drafts would be other tokens), or
    weights that transformers cannot read as the config's model."""
    from transformers import AutoConfig

    where = str(Path(directory) / "config.json")
    config = AutoConfig.from_pretrained(str(directory))
    problems = []
    draft_vocab, target_vocab = text_config(config).vocab_size, text_config(target_config).vocab_size
    if draft_vocab != target_vocab:
        problems.append(Problem(where, "vocab_size", f"the draft model's vocab_size {draft_vocab} != the target's "
                                                      f"{target_vocab}: a draft model must share its target's vocabulary"))
    if not (Path(directory) / "model.safetensors").is_file() and not (Path(directory) / "model.safetensors.index.json").is_file():
        problems.append(Problem(str(directory), "model.safetensors", "no weights: expected model.safetensors"))
    return problems
