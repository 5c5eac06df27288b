"""EAGLE-3 in vLLM's speculators layout (docs/FORMATS.md section B), to and from headstart's flat one.

``vllm serve <head>`` detects this layout by ``speculators_model_type`` and needs nothing else: the
config names the verifier (the target) and the proposal method. The first decoder layer is
``layers.0.*`` instead of the flat layout's ``midlayer.*``; every other tensor keeps its name (a multi-layer draft's
later layers are ``layers.{i}.*`` in both).

Written explicitly, because readers fall back silently when a key is absent:
- ``eagle_aux_hidden_state_layer_ids`` (vLLM ids): absent or null, vLLM and speculators use their
  default ``[2, L//2, L-3]`` -- right for the demo by chance, wrong for any other choice;
- ``norm_before_residual``: absent means true on this route (headstart trains false);
- ``draft_vocab_size`` and ``target_hidden_size``.

EAGLE-3.1's two norms (``fc_norm``, ``norm_output``) are top-level keys here as in the flat layout, both ways. The
reader refuses options headstart's head does not implement (``norm_before_residual``, ``norm_before_fc`` true)
instead of loading a different network.
"""

from __future__ import annotations

from pathlib import Path

from headstart.models.head import DEFAULT_SPECULATIVE_TOKENS

SPECULATORS_VERSION = "0.9.0"  # the speculators release the conformance tests read these exports with
ARCHITECTURE = "Eagle3DraftModel"
ARCHITECTURES = (ARCHITECTURE, "Eagle3Speculator")  # speculators <= 0.9 writes the older name
FLAT_LAYER, SPECULATORS_LAYER = "midlayer.", "layers.0."  # the decoder layer's prefix in each layout
UNSUPPORTED = ("norm_before_fc",)  # speculators options headstart's head does not have
NORMS = ("fc_norm", "norm_output")  # EAGLE-3.1's, carried as they are


def is_speculators(config: dict) -> bool:
    return "speculators_model_type" in config


def layer_rope(layer: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope scaling or None) of a decoder config dict, either transformers convention."""
    rope = layer.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", layer.get("rope_theta", 10000.0)))
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if rope else layer.get("rope_scaling")
    return theta, (scaling if scaling and scaling.get("rope_type", "default") != "default" else None)


def to_speculators_config(flat: dict, verifier: dict | None, model_type: str = "eagle3",
                          architecture: str = ARCHITECTURE) -> dict:
    """config.json in the speculators layout, from the flat layout's (``Eagle3Config.to_hf_dict``). ``verifier``: the
    target's ``provenance.fingerprint`` (its path and architectures); vLLM refuses a speculators config that does not name the target.
    ``model_type``/``architecture``: speculators' names for a head built on EAGLE-3's (its config class's)."""
    if not (verifier or {}).get("name_or_path"):
        raise ValueError("the speculators layout names the target (speculators_config.verifier) and vLLM refuses "
                         "it without one: give the target's path")
    path = Path(verifier["name_or_path"])
    # vLLM resolves the verifier from where it is started: a local target is written as an absolute path.
    name_or_path = str(path.resolve()) if (path / "config.json").is_file() else verifier["name_or_path"]
    rope = {"rope_type": "default", **(flat["rope_scaling"] or {}), "rope_theta": flat["rope_theta"]}
    layer = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": flat.get("num_hidden_layers", 1),
        "hidden_size": flat["hidden_size"],
        "num_attention_heads": flat["num_attention_heads"],
        "num_key_value_heads": flat["num_key_value_heads"],
        "head_dim": flat["head_dim"],
        "intermediate_size": flat["intermediate_size"],
        "hidden_act": flat["hidden_act"],
        "rms_norm_eps": flat["rms_norm_eps"],
        "rope_parameters": rope,
        # transformers < 5 reads these two instead of rope_parameters.
        "rope_theta": flat["rope_theta"],
        "rope_scaling": flat["rope_scaling"],
        "max_position_embeddings": flat["max_position_embeddings"],
        "vocab_size": flat["vocab_size"],
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }
    return {
        "architectures": [architecture],
        "speculators_model_type": model_type,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": flat["draft_vocab_size"],
        "target_hidden_size": flat["target_hidden_size"],
        "norm_before_residual": False,
        "norm_before_fc": False,
        **{key: bool(flat.get(key, False)) for key in NORMS},
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "eagle_aux_hidden_state_layer_ids": list(flat["eagle_aux_hidden_state_layer_ids"]),
        "speculators_config": {
            "algorithm": model_type,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": flat["headstart"]["speculative_tokens"],
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": name_or_path,
                         "architectures": list(verifier.get("architectures") or [])},
        },
        "headstart": {"target_num_layers": flat["headstart"]["target_num_layers"]},
        "torch_dtype": "bfloat16",
    }


def flat_from_speculators(d: dict, where: str = "config.json", model_type: str = "eagle3",
                          architectures: tuple[str, ...] = ARCHITECTURES) -> dict:
    """The flat layout's config.json for a speculators-layout one (``Eagle3Config.from_hf_dict`` reads it); refused by
    key if headstart cannot run it. ``model_type``/``architectures``: what a head built on EAGLE-3's is called there."""
    problems = []
    if d.get("speculators_model_type") != model_type:
        problems.append(f"speculators_model_type is {d.get('speculators_model_type')!r}, not {model_type!r}")
    if d.get("architectures") and d["architectures"][0] not in architectures:
        problems.append(f"architectures {d['architectures']} is not one of {list(architectures)}")
    layer = d.get("transformer_layer_config")
    if not isinstance(layer, dict):
        problems.append("transformer_layer_config is missing")
        layer = {}
    for key in ("draft_vocab_size", "eagle_aux_hidden_state_layer_ids"):
        if d.get(key) in (None, []):
            problems.append(f"{key} is missing, null or empty (vLLM would fall back to a default silently)")
    if d.get("norm_before_residual", True):
        problems.append("norm_before_residual is true or absent (absent means true on this route); headstart's "
                        "head adds the un-normed hidden state")
    problems += [f"{key} is true; headstart's head has no such norm" for key in UNSUPPORTED if d.get(key)]
    if problems:
        raise ValueError(f"{where}: cannot read this speculators {model_type} config:\n  " + "\n  ".join(problems))
    # The rest is the flat layout's mapping: a flat config (one place maps fields to Eagle3Config).
    rope_theta, scaling = layer_rope(layer)
    proposals = (d.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return {
        **layer, "architectures": ["LlamaForCausalLMEagle3"], "rope_theta": rope_theta, "rope_scaling": scaling,
        "draft_vocab_size": d["draft_vocab_size"], "target_hidden_size": d.get("target_hidden_size"),
        "eagle_aux_hidden_state_layer_ids": d["eagle_aux_hidden_state_layer_ids"],
        **{key: bool(d.get(key, False)) for key in NORMS},
        "headstart": {**(d.get("headstart") or {}), "speculative_tokens": proposals[0].get("speculative_tokens", DEFAULT_SPECULATIVE_TOKENS)},
    }


def to_speculators_tensors(tensors: dict) -> dict:
    return {(SPECULATORS_LAYER + k[len(FLAT_LAYER):] if k.startswith(FLAT_LAYER) else k): v
            for k, v in tensors.items()}


def from_speculators_tensors(tensors: dict) -> dict:
    return {(FLAT_LAYER + k[len(SPECULATORS_LAYER):] if k.startswith(SPECULATORS_LAYER) else k): v
            for k, v in tensors.items()}
