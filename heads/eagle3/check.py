"""EAGLE-3's ``check_head`` rules: its export read key by key against the target's config, naming for each
mistake what vLLM and SGLang would do with it (docs/FORMATS.md, and the loaders cited in
tests/test_server_loaders.py):

- a tensor name the layout does not have: vLLM raises, SGLang drops it without a word (a flat head
  with ``layers.0.*`` names loads in SGLang with a random decoder layer);
- a missing ``lm_head``: vLLM uses the target's (full vocab, wrong head), SGLang leaves it
  uninitialised unless ``draft_vocab_size`` is null, in which case it uses the target's;
- a missing ``d2t``: both treat the draft vocab as the first V_d target ids;
- aux layer ids: vLLM reads the top-level ones, SGLang only ``eagle_config``'s, which it captures + 1;
  absent, each uses its default, right only by chance;
- ``norm_before_residual`` absent means true on vLLM's speculators route;
- ``max_position_embeddings`` below the target's: SGLang does not raise it, long prompts fail;
- EAGLE-3.1's ``fc_norm``: one ``fc_norm.{i}.weight`` [H_t] per aux layer, present exactly when the key is true
  (a norm the config does not switch on is a tensor vLLM refuses; one it switches on but lacks stays random).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from headstart.models.draft_vocab import check_draft_vocab
from headstart.models.problem import Problem, tensor_meta
from headstart.models.rope import rope_of
from headstart.heads.eagle3.speculators import ARCHITECTURES, FLAT_LAYER, SPECULATORS_LAYER, UNSUPPORTED, layer_rope
from headstart.models.target import text_config

_FLAT, _SPECULATORS = "flat", "speculators"


def detect_eagle3(directory: Path, config: dict) -> str | None:
    """The layout of an exported head whose config.json is ``config``, if it is an EAGLE-3 head's. A flat config with
    vLLM's parallel-drafting key ``pard_token`` is a P-EAGLE head's (the same architecture, one more tensor)."""
    if config.get("speculators_model_type") == "eagle3":
        return _SPECULATORS
    flat = (config.get("architectures") or [None])[0] == "LlamaForCausalLMEagle3"
    return _FLAT if flat and "pard_token" not in config else None


def check_eagle3(directory: Path, layout: str, target_config, more_tensors: dict[str, tuple] | None = None,
                 architectures: tuple[str, ...] = ARCHITECTURES) -> list[Problem]:
    """The problems of an EAGLE-3 export. A head built on EAGLE-3's passes the tensors it adds (``more_tensors``: name
    -> shape) and the speculators architectures it is written under."""
    cfg_file, st_file = str(directory / "config.json"), str(directory / "model.safetensors")
    problems: list[Problem] = []

    def bad(file: str, key: str, message: str) -> None:
        problems.append(Problem(file, key, message))

    d = json.loads((directory / "config.json").read_text())
    tc = text_config(target_config)
    H_t, V, L = tc.hidden_size, tc.vocab_size, tc.num_hidden_layers
    if not (directory / "model.safetensors").is_file():
        return [Problem(st_file, "-", "missing: the head's tensors are not there")]
    meta = tensor_meta(directory / "model.safetensors")

    # -- config ---------------------------------------------------------------------------------
    layer = d.get("transformer_layer_config") or {} if layout == _SPECULATORS else d
    lk = "transformer_layer_config." if layout == _SPECULATORS else ""
    H = layer.get("hidden_size")
    V_d = d.get("draft_vocab_size")
    if V_d is None:
        bad(cfg_file, "draft_vocab_size", "missing or null: SGLang then uses the target's full-vocab lm_head, vLLM "
            "sizes the head as the full vocab")
    if H != H_t:
        bad(cfg_file, lk + "hidden_size", f"{H} != the target's hidden_size {H_t} (servers give the draft the target's "
            "embedding, so they must match)")
    if d.get("target_hidden_size") not in (None, H_t):
        bad(cfg_file, "target_hidden_size", f"{d['target_hidden_size']} != the target's hidden_size {H_t}")
    if layout == _SPECULATORS and d.get("target_hidden_size") is None:
        bad(cfg_file, "target_hidden_size", "missing: write it explicitly")
    if layer.get("vocab_size") != V:
        bad(cfg_file, lk + "vocab_size", f"{layer.get('vocab_size')} != the target's vocab_size {V}")
    n_layers = layer.get("num_hidden_layers")
    if not isinstance(n_layers, int) or n_layers < 1:
        bad(cfg_file, lk + "num_hidden_layers", f"{n_layers!r}: the draft's decoder layers, a count >= 1")
        n_layers = 1
    if layout == _FLAT and d.get("tie_word_embeddings"):
        bad(cfg_file, "tie_word_embeddings", "true: SGLang then uses the embedding as the lm_head")
    if layout == _SPECULATORS:
        spec = d.get("speculators_config") or {}
        if not (spec.get("verifier") or {}).get("name_or_path"):
            bad(cfg_file, "speculators_config.verifier.name_or_path", "missing: vLLM refuses the config without it")
        if not (spec.get("proposal_methods") or [{}])[0].get("speculative_tokens"):
            bad(cfg_file, "speculators_config.proposal_methods", "no speculative_tokens: vLLM refuses the config")
    if layout == _FLAT and d.get("architectures") != ["LlamaForCausalLMEagle3"]:
        bad(cfg_file, "architectures", f"{d.get('architectures')}: the flat layout is exactly ['LlamaForCausalLMEagle3']")
    if layout == _SPECULATORS:
        if (d.get("architectures") or [architectures[0]])[0] not in architectures:
            bad(cfg_file, "architectures", f"{d.get('architectures')}: not one of {list(architectures)}")
    for key in UNSUPPORTED:
        if d.get(key):
            bad(cfg_file, key, "true: a norm headstart's head does not have (headstart cannot decode it)")
    nbr = d.get("norm_before_residual")
    if nbr or (layout == _SPECULATORS and nbr is None):
        bad(cfg_file, "norm_before_residual", f"{'absent (true on this route)' if nbr is None else nbr}: headstart's "
            "heads add the un-normed hidden state; SGLang implements only false")

    ids = d.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        bad(cfg_file, "eagle_aux_hidden_state_layer_ids", f"{ids!r}: vLLM falls back to its default "
            f"{[2, L // 2, L - 3]} without a word; write the ids the head was trained with")
    else:
        if not isinstance(ids, list) or any(not isinstance(i, int) or not 1 <= i < L for i in ids) or ids != sorted(set(ids)):
            bad(cfg_file, "eagle_aux_hidden_state_layer_ids", f"{ids}: vLLM ids must be strictly increasing within "
                f"[1, {L - 1}] for a target of {L} layers (id k = the residual entering layer k)")
        if layout == _FLAT:
            nested = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            want = [i - 1 for i in ids] if isinstance(ids, list) and all(isinstance(i, int) for i in ids) else "?"
            if nested != want:
                bad(cfg_file, "eagle_config.eagle_aux_hidden_state_layer_ids", f"{nested!r}, but SGLang reads only this "
                    f"key and captures id + 1: for the vLLM ids {ids} it must be {want}")
            if (d.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
                bad(cfg_file, "eagle_config.use_aux_hidden_state", "false: the servers then skip fc")

    tc_max = getattr(tc, "max_position_embeddings", None)
    if tc_max and (layer.get("max_position_embeddings") or 0) < tc_max:
        bad(cfg_file, lk + "max_position_embeddings", f"{layer.get('max_position_embeddings')} < the target's {tc_max}: "
            "SGLang keeps the draft's limit, so long prompts fail")
    theta, scaling = rope_of(tc)
    mine_theta, mine_scaling = layer_rope(layer)
    if abs(mine_theta - theta) > 1e-6 * theta:
        bad(cfg_file, lk + "rope_theta", f"{mine_theta} != the target's {theta}")
    mine_type = (mine_scaling or {}).get("rope_type") or "default"
    if mine_type != ((scaling or {}).get("rope_type") or "default"):
        bad(cfg_file, lk + "rope_scaling", f"rope type {mine_type!r} != the target's "
            f"{(scaling or {}).get('rope_type') or 'default'!r}")

    # -- tensors --------------------------------------------------------------------------------
    prefix = FLAT_LAYER if layout == _FLAT else SPECULATORS_LAYER
    other = SPECULATORS_LAYER if layout == _FLAT else FLAT_LAYER
    heads, kv = layer.get("num_attention_heads") or 1, layer.get("num_key_value_heads") or layer.get("num_attention_heads") or 1
    hd = layer.get("head_dim") or (H or 0) // heads
    inter = layer.get("intermediate_size")
    n_aux = len(ids) if isinstance(ids, list) and ids else 3
    expected = {
        "fc.weight": (H, n_aux * H_t),
        prefix + "self_attn.q_proj.weight": (heads * hd, 2 * (H or 0)),
        prefix + "self_attn.k_proj.weight": (kv * hd, 2 * (H or 0)),
        prefix + "self_attn.v_proj.weight": (kv * hd, 2 * (H or 0)),
        prefix + "self_attn.o_proj.weight": (H, heads * hd),
        prefix + "input_layernorm.weight": (H,),
        prefix + "hidden_norm.weight": (H,),
        prefix + "post_attention_layernorm.weight": (H,),
        prefix + "mlp.gate_proj.weight": (inter, H),
        prefix + "mlp.up_proj.weight": (inter, H),
        prefix + "mlp.down_proj.weight": (H, inter),
        "norm.weight": (H,),
        "lm_head.weight": (V_d, H),
        "d2t": (V_d,),
        "t2d": (V,),
    }
    for i in range(1, n_layers):  # a multi-layer draft's later layers: plain Llama layers on the first's output
        later = f"layers.{i}."
        expected.update({later + "self_attn.q_proj.weight": (heads * hd, H), later + "self_attn.k_proj.weight": (kv * hd, H),
                         later + "self_attn.v_proj.weight": (kv * hd, H), later + "self_attn.o_proj.weight": (H, heads * hd),
                         later + "input_layernorm.weight": (H,), later + "post_attention_layernorm.weight": (H,),
                         later + "mlp.gate_proj.weight": (inter, H), later + "mlp.up_proj.weight": (inter, H),
                         later + "mlp.down_proj.weight": (H, inter)})
    if d.get("fc_norm"):  # EAGLE-3.1
        expected.update({f"fc_norm.{i}.weight": (H_t,) for i in range(n_aux)})
    expected.update(more_tensors or {})
    optional = {"embed_tokens.weight": (V, H)}
    if layout == _SPECULATORS:  # midlayer.* names count as layers.0.* (vLLM maps them)
        meta = {(SPECULATORS_LAYER + k[len(FLAT_LAYER):] if k.startswith(FLAT_LAYER) else k): v for k, v in meta.items()}
    for name, shape in expected.items():
        if name not in meta:
            why = {"lm_head.weight": "vLLM then uses the target's full-vocab head, SGLang an uninitialised one",
                   "d2t": "both servers then map draft id i to target id i"}.get(name, "the servers leave it random")
            bad(st_file, name, f"missing: {why}")
        elif meta[name][0] != shape:
            bad(st_file, name, f"shape {list(meta[name][0])}, expected {list(shape)} for this config and target")
    for name in sorted(set(meta) - set(expected) - set(optional)):
        if name.startswith(other):
            if layout == _FLAT:  # vLLM maps both prefixes; SGLang has only midlayer
                bad(st_file, name, f"not a tensor of the flat EAGLE-3 layout: SGLang drops it silently (vLLM loads "
                    f"it; this layout names the decoder layer {prefix}*)")
            elif FLAT_LAYER + name[len(other):] in expected or prefix + name[len(other):] in expected:
                continue  # vLLM, the only reader of this layout, maps midlayer.* to layers.0.* too
        else:
            bad(st_file, name, f"not a tensor of the {layout} EAGLE-3 layout: vLLM raises, SGLang drops it silently")
    if "embed_tokens.weight" in meta and meta["embed_tokens.weight"][0] != optional["embed_tokens.weight"]:
        bad(st_file, "embed_tokens.weight", f"shape {list(meta['embed_tokens.weight'][0])}, expected {[V, H]}")
    floats = {dt for name, (_, dt) in meta.items() if name not in ("d2t", "t2d")}
    if len(floats) > 1:
        bad(st_file, "dtype", f"weights of mixed dtypes {sorted(floats)}")
    dtype = d.get("torch_dtype") or d.get("dtype")
    stored = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}.get(next(iter(floats), ""), None)
    if dtype and stored and dtype != stored:
        bad(cfg_file, "torch_dtype", f"{dtype}, but the weights are stored as {stored}")

    # -- draft vocab ----------------------------------------------------------------------------
    if "d2t" in meta and "t2d" in meta and V_d is not None and meta["d2t"][0] == (V_d,) and meta["t2d"][0] == (V,):
        with safe_open(st_file, framework="pt") as f:
            d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
        if d2t.dtype != torch.int64:
            bad(st_file, "d2t", f"dtype {d2t.dtype}, expected int64 offsets")
        if t2d.dtype != torch.bool:
            bad(st_file, "t2d", f"dtype {t2d.dtype}, expected bool")
        try:
            check_draft_vocab(d2t.long(), t2d.bool())
        except ValueError as err:
            bad(st_file, str(err).split(":")[0].split()[0], str(err))
    return problems


def eagle3_trained_depth(config: dict) -> int | None:
    """The drafts per round an export says to run (``speculative_tokens``: headstart's record in the flat layout, the
    proposal method's in the speculators one); None when it says nothing."""
    proposals = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return (config.get("headstart") or {}).get("speculative_tokens") or proposals[0].get("speculative_tokens")
