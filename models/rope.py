"""The target's rotary embedding settings, which a draft layer attending over the target's positions copies (EAGLE-3,
DFlash)."""

from __future__ import annotations


def rope_of(tc) -> tuple[float, dict | None]:
    """The target's text config -> (rope theta, rope scaling or None)."""
    params = getattr(tc, "rope_parameters", None)  # transformers >= 5
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        # One set per layer type (Gemma 3: sliding 1e4, full 1e6): the draft's one layer attends over the whole
        # context, as the target's full-attention layers do.
        params = params.get("full_attention") or next(iter(params.values()))
    if isinstance(params, dict) and "rope_theta" in params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        return float(params["rope_theta"]), (scaling if scaling.get("rope_type", "default") != "default" else None)
    return float(getattr(tc, "rope_theta", 10000.0)), getattr(tc, "rope_scaling", None)


def rope_original_max(scaling: dict | None) -> int:
    """A scaled rope's ``original_max_position_embeddings`` plus one (1 unscaled): the fewest
    ``max_position_embeddings`` a draft's LlamaConfig is built with (heads/eagle3/config.py, heads/dflash/config.py)."""
    return int((scaling or {}).get("original_max_position_embeddings", 0)) + 1
