"""EAGLE-3 in vLLM's speculators layout (docs/FORMATS.md section B), to and from headstart's flat one.

``vllm serve <head>`` detects this layout by ``speculators_model_type`` and needs nothing else: the
config names the verifier (the target) and the proposal method. The decoder layer is
``layers.0.*`` instead of the flat layout's ``midlayer.*``; every other tensor keeps its name.

Written explicitly, because readers fall back silently when a key is absent:
- ``eagle_aux_hidden_state_layer_ids`` (vLLM ids): absent or null, vLLM and speculators use their
  default ``[2, L//2, L-3]`` -- right for the demo by chance, wrong for any other choice;
- ``norm_before_residual``: absent means true on this route (headstart trains false);
- ``draft_vocab_size`` and ``target_hidden_size``.

The reader refuses options headstart's head does not implement (``norm_before_residual``,
``norm_before_fc``, ``fc_norm``, ``norm_output`` true) instead of loading a different network.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from headstart.models.eagle3 import Eagle3Config
from headstart.models.export import replace_dir
from headstart.models.head import DEFAULT_SPECULATIVE_TOKENS
from headstart.models.provenance import read_provenance, write_provenance

SPECULATORS_VERSION = "0.9.0"  # the speculators release the conformance tests read these exports with
ARCHITECTURE = "Eagle3DraftModel"
ARCHITECTURES = (ARCHITECTURE, "Eagle3Speculator")  # speculators <= 0.9 writes the older name
FLAT_LAYER, SPECULATORS_LAYER = "midlayer.", "layers.0."  # the decoder layer's prefix in each layout
UNSUPPORTED = ("norm_before_fc", "fc_norm", "norm_output")  # speculators options headstart's head does not have


def is_speculators(config: dict) -> bool:
    return "speculators_model_type" in config


def layer_rope(layer: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope scaling or None) of a decoder config dict, either transformers convention."""
    rope = layer.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", layer.get("rope_theta", 10000.0)))
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if rope else layer.get("rope_scaling")
    return theta, (scaling if scaling and scaling.get("rope_type", "default") != "default" else None)


def to_speculators_config(config: Eagle3Config, verifier: dict | None) -> dict:
    """config.json in the speculators layout. ``verifier``: the target's ``provenance.fingerprint``
    (its path and architectures); vLLM refuses a speculators config that does not name the target."""
    if not (verifier or {}).get("name_or_path"):
        raise ValueError("the speculators layout names the target (speculators_config.verifier) and vLLM refuses "
                         "it without one: give the target's path")
    path = Path(verifier["name_or_path"])
    # vLLM resolves the verifier from where it is started: a local target is written as an absolute path.
    name_or_path = str(path.resolve()) if (path / "config.json").is_file() else verifier["name_or_path"]
    rope = {"rope_type": "default", **(config.rope_scaling or {}), "rope_theta": config.rope_theta}
    layer = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 1,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": rope,
        # transformers < 5 reads these two instead of rope_parameters.
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }
    return {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config.speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": name_or_path,
                         "architectures": list(verifier.get("architectures") or [])},
        },
        "headstart": {"target_num_layers": config.target_num_layers},
        "torch_dtype": "bfloat16",
    }


def from_speculators_config(d: dict, where: str = "config.json") -> Eagle3Config:
    """An Eagle3Config from a speculators-layout config; refused by key if headstart cannot run it."""
    problems = []
    if d.get("speculators_model_type") != "eagle3":
        problems.append(f"speculators_model_type is {d.get('speculators_model_type')!r}, not 'eagle3'")
    if d.get("architectures") and d["architectures"][0] not in ARCHITECTURES:
        problems.append(f"architectures {d['architectures']} is not one of {list(ARCHITECTURES)}")
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
    if layer.get("num_hidden_layers", 1) != 1:
        problems.append(f"transformer_layer_config.num_hidden_layers is {layer.get('num_hidden_layers')}, not 1")
    if problems:
        raise ValueError(f"{where}: cannot read this speculators EAGLE-3 config:\n  " + "\n  ".join(problems))
    # The rest is the flat layout's mapping: read it as a flat config (one place maps fields to Eagle3Config).
    rope_theta, scaling = layer_rope(layer)
    proposals = (d.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return Eagle3Config.from_hf_dict({
        **layer, "architectures": ["LlamaForCausalLMEagle3"], "rope_theta": rope_theta, "rope_scaling": scaling,
        "draft_vocab_size": d["draft_vocab_size"], "target_hidden_size": d.get("target_hidden_size"),
        "eagle_aux_hidden_state_layer_ids": d["eagle_aux_hidden_state_layer_ids"],
        "headstart": {**(d.get("headstart") or {}), "speculative_tokens": proposals[0].get("speculative_tokens", DEFAULT_SPECULATIVE_TOKENS)},
    })


def to_speculators_tensors(tensors: dict) -> dict:
    return {(SPECULATORS_LAYER + k[len(FLAT_LAYER):] if k.startswith(FLAT_LAYER) else k): v
            for k, v in tensors.items()}


def from_speculators_tensors(tensors: dict) -> dict:
    return {(FLAT_LAYER + k[len(SPECULATORS_LAYER):] if k.startswith(SPECULATORS_LAYER) else k): v
            for k, v in tensors.items()}


def convert_eagle3(source: str | Path, out: str | Path, to: str, verifier: dict | None = None,
                   force: bool = False) -> Path:
    """Rewrite an exported EAGLE-3 head in the other layout without touching a tensor's values or dtype.

    ``verifier`` (a fingerprint) names the target in a speculators config; default: the one the head
    records (``headstart.json``) or, converting from speculators, the one its config names. ``out``
    must not hold anything unless ``force``; it appears whole or not at all."""
    source, out = Path(source), Path(out)
    if to not in ("flat", "speculators"):
        raise ValueError(f"--to must be flat or speculators, got {to!r}")
    for name in ("config.json", "model.safetensors"):
        if not (source / name).is_file():
            raise FileNotFoundError(f"{source}: no {name}; expected an exported EAGLE-3 head")
    if out.resolve() == source.resolve() or source.resolve() in out.resolve().parents:
        raise ValueError(f"--out {out} is (inside) the head's own directory; write the converted head elsewhere")
    if out.exists() and any(out.iterdir()) and not force:
        raise ValueError(f"--out {out} already holds files; choose an empty directory (or --force to replace it)")
    raw = json.loads((source / "config.json").read_text())
    config = Eagle3Config.from_json(source / "config.json")
    record = read_provenance(source) or {"head": "eagle3"}
    target = record.get("target") or verifier
    if verifier is None:
        verifier = record.get("target") or ((raw.get("speculators_config") or {}).get("verifier") if is_speculators(raw) else None)
    tensors = load_file(str(source / "model.safetensors"))
    if is_speculators(raw):
        tensors = from_speculators_tensors(tensors)
    if to == "speculators":
        tensors, new_config = to_speculators_tensors(tensors), to_speculators_config(config, verifier)
    else:
        new_config = config.to_hf_dict()
    floats = {v.dtype for v in tensors.values() if v.is_floating_point()}
    new_config["torch_dtype"] = str(floats.pop()).removeprefix("torch.") if len(floats) == 1 else new_config["torch_dtype"]
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(new_config, indent=2))
    write_provenance(tmp, record.get("head", "eagle3"), to, target)
    replace_dir(tmp, out)
    return out
