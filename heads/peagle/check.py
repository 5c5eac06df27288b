"""P-EAGLE's ``check_head`` rules: EAGLE-3's (heads/eagle3/check.py) for the shared network, plus what vLLM's parallel
drafting reads: the ``mask_hidden`` tensor (vLLM raises without it) and the placeholder token (its V1 proposer reads
``mask_token_id`` or ``pard_token``, its V2 runner only ``pard_token``; the speculators route maps ``mask_token_id``)."""

from __future__ import annotations

import json
from pathlib import Path

from headstart.heads.eagle3.check import check_eagle3, eagle3_trained_depth
from headstart.heads.peagle.config import PEagleConfig
from headstart.models.problem import Problem
from headstart.models.target import text_config


def detect_peagle(directory: Path, config: dict) -> str | None:
    """The layout of an exported head whose config.json is ``config``, if it is a P-EAGLE head's."""
    if config.get("speculators_model_type") == PEagleConfig.speculators_type:
        return "speculators"
    flat = (config.get("architectures") or [None])[0] == "LlamaForCausalLMEagle3"
    return "flat" if flat and "pard_token" in config else None


def check_peagle(directory: Path, layout: str, target_config) -> list[Problem]:
    d = json.loads((directory / "config.json").read_text())
    tc = text_config(target_config)
    ids = d.get("eagle_aux_hidden_state_layer_ids")
    n_aux = len(ids) if isinstance(ids, list) and ids else 3
    problems = check_eagle3(directory, layout, target_config, {"mask_hidden": (1, 1, n_aux * tc.hidden_size)},
                            PEagleConfig.speculators_architectures)
    cfg_file = str(directory / "config.json")
    keys = ("mask_token_id", "pard_token") if layout == "flat" else ("mask_token_id",)
    for key in keys:
        token = d.get(key)
        if token is None:
            problems.append(Problem(cfg_file, key, "missing: vLLM's parallel drafting cannot place the not-yet-drafted "
                                    "positions without it"))
        elif not isinstance(token, int) or not 0 <= token < tc.vocab_size:
            problems.append(Problem(cfg_file, key, f"{token!r} is not a token id of the target's vocab ({tc.vocab_size})"))
    if layout == "flat" and d.get("pard_token") != d.get("mask_token_id"):
        problems.append(Problem(cfg_file, "pard_token", f"{d.get('pard_token')!r} != mask_token_id "
                                f"{d.get('mask_token_id')!r}: vLLM's two proposers would place different tokens"))
    if d.get("norm_output"):
        problems.append(Problem(cfg_file, "norm_output", "true: a P-EAGLE head carries no state between drafts, and "
                                "vLLM's parallel drafting does not read it"))
    return problems


def peagle_trained_depth(config: dict) -> int | None:
    """The depths trained in parallel (``parallel_tokens``), else what the EAGLE-3 export records."""
    return (config.get("headstart") or {}).get("parallel_tokens") or eagle3_trained_depth(config)
