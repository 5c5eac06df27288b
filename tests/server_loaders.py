"""What vLLM's and SGLang's EAGLE-3 loaders do with a checkpoint, written down from their source.

The real loaders need a GPU build of each server, so the tests (tests/test_server_loaders.py) run
these models of them instead: the tensor-name mapping, the config keys read and their defaults, and
which target layers get captured. Each rule cites the source it was read from (repo@commit:path:lines;
"@off N" = character offset in that file where line numbers could not be fixed). Written from
reading, not copied: the point is what a checkpoint turns into, not how the servers compute.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Parameters of one EAGLE-3 decoder layer after the servers' stacking of q/k/v and gate/up.
_LAYER_PARAMS = ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight",
                 "mlp.down_proj.weight", "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight")
_STACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
            "up_proj": "gate_up_proj"}


@dataclass
class Loaded:
    params: dict[str, list[str]] = field(default_factory=dict)  # server parameter -> checkpoint tensors in it
    dropped: list[str] = field(default_factory=list)  # checkpoint tensors the server ignored without a word
    lm_head: str = "draft"  # draft | target (the target's full-vocab head) | uninitialised
    d2t: str = "stored"  # stored | identity
    capture: tuple[int, ...] = ()  # HF hidden_states indices of the target the server feeds the head
    norm_before_residual: bool = False


def _stack(name: str) -> str:
    for part, stacked in _STACKED.items():
        name = name.replace(f".{part}.", f".{stacked}.")
    return name


def vllm_flat(config: dict, names: list[str], num_layers: int) -> Loaded:
    """vLLM's ``Eagle3LlamaForCausalLM`` on a flat config (``--speculative-config '{"method": "eagle3"}'``).

    vllm-project/vllm@00bd1493b3e82d6c13c68ee8a0e1c5a96707e190:vllm/model_executor/models/llama_eagle3.py
      L429-478 load_weights: names containing t2d dropped (L435-436); d2t -> draft_id_to_target_id
      (L437-439); every name without lm_head gets the prefix model. (L452-453); LlamaModel.load_weights maps
      midlayer. to layers.0. (L296-297) and indexes params_dict[name] bare, so an unknown name raises
      KeyError (L320, L325); a missing d2t leaves draft_id_to_target_id at zeros, the identity (L361-364,
      L467-468); norm_before_residual = getattr(config, ..., False) (L132-135).
    vllm-project/vllm@82720b1ed4712ddebb597acdbcff752db48a76c1:vllm/v1/spec_decode/llm_base_proposer.py @off 52000
      _maybe_share_lm_head: without its own lm_head tensor the draft uses the target's.
    vllm-project/vllm@da84445036cc0892da52c329f330064cba1a46ab:vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py
      L26-46: the aux layer ids come from the top-level eagle_aux_hidden_state_layer_ids only, else the
      model's default; vllm-project/vllm@e06c9ba2a6ea923a84add30f5dafaea126429b81:vllm/model_executor/models/
      llama.py @off 12000: layer idx in the ids appends hidden_states + residual *before* layer idx runs
      (= HF hidden_states[idx]); default (2, L//2, L-3).
    """
    out = Loaded(norm_before_residual=bool(config.get("norm_before_residual", False)))
    params = {f"model.layers.0.{p}" for p in _LAYER_PARAMS} | {"model.fc.weight", "model.norm.weight", "lm_head.weight",
                                                               "draft_id_to_target_id", "model.embed_tokens.weight"}
    for name in names:
        if "t2d" in name:
            out.dropped.append(name)
            continue
        mapped = "draft_id_to_target_id" if name == "d2t" else name if "lm_head" in name else "model." + name
        mapped = _stack(mapped.replace("model.midlayer.", "model.layers.0."))
        if mapped not in params:
            raise KeyError(f"vLLM: no parameter {mapped!r} for checkpoint tensor {name!r}")
        out.params.setdefault(mapped, []).append(name)
    out.lm_head = "draft" if "lm_head.weight" in out.params else "target"
    out.d2t = "stored" if "draft_id_to_target_id" in out.params else "identity"
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    out.capture = tuple(ids) if ids else (2, num_layers // 2, num_layers - 3)
    return out


def vllm_speculators_config(config: dict) -> dict:
    """The draft hf-config vLLM builds from a speculators-layout config.json.

    vllm-project/vllm@94699746757f9d68e2f4bd89ad2c4b10ed962457:vllm/transformers_utils/configs/speculators/base.py
      L27-31: speculators_model_type must be registered (eagle3); L43-59: speculative_tokens, the verifier's
      name_or_path and a dict transformer_layer_config are required; L34-41, L72-91: the hf-config is
      {method, num_lookahead_tokens, target_model} updated with transformer_layer_config, then
    vllm-project/vllm@cfb173ab8e1b8e44dd35f8b5188255b6a03e13ec:vllm/transformers_utils/configs/speculators/algos.py
      L30-38 update_eagle3: draft_vocab_size as is; target_hidden_size if not None; norm_before_residual
      with default True (L33); architectures forced to Eagle3LlamaForCausalLM (L34); the aux ids only if
      truthy (L35-38).
    """
    if config.get("speculators_model_type") != "eagle3":
        raise ValueError(f"vLLM: unsupported speculators_model_type {config.get('speculators_model_type')!r}")
    spec = config.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or [{}]
    layer = config.get("transformer_layer_config")
    verifier = (spec.get("verifier") or {}).get("name_or_path")
    if not isinstance(layer, dict) or methods[0].get("speculative_tokens") is None or not verifier:
        raise ValueError("vLLM: a speculators config needs transformer_layer_config, speculative_tokens and a verifier")
    hf = {"method": "eagle3", "num_lookahead_tokens": methods[0]["speculative_tokens"], "target_model": verifier, **layer}
    hf["draft_vocab_size"] = config.get("draft_vocab_size")
    if config.get("target_hidden_size") is not None:
        hf["target_hidden_size"] = config["target_hidden_size"]
    hf["norm_before_residual"] = config.get("norm_before_residual", True)
    hf["architectures"] = ["Eagle3LlamaForCausalLM"]
    if config.get("eagle_aux_hidden_state_layer_ids"):
        hf["eagle_aux_hidden_state_layer_ids"] = config["eagle_aux_hidden_state_layer_ids"]
    return hf


def sglang_flat(config: dict, names: list[str], num_layers: int) -> Loaded:
    """SGLang's ``LlamaForCausalLMEagle3``.

    sgl-project/sglang@03d5a7771f6082e7737a5f19cae7d1e863087013:python/sglang/srt/models/llama_eagle3.py
      L202-207: the layer module is named midlayer; L338, L348: a name not found gets the prefix model.;
      L339, L349: names with no parameter are skipped silently; L331-332: t2d dropped; L326-329: d2t becomes
      hot_token_id = d2t + arange; L311: no d2t leaves hot_token_id None (no remap); L294-296: a null
      draft_vocab_size loads the target's lm_head; L145-147: the residual is always the raw hidden state
      (norm_before_residual is never read).
    sgl-project/sglang@0005834cdb2a5b7472789ccbf0d3361b5cf853b8:python/sglang/srt/model_executor/model_runner.py
      @off 16000: the aux ids come from eagle_config.eagle_aux_hidden_state_layer_ids only (None if absent);
    sgl-project/sglang@bf7a0e237e8d5b2ce5402f5d2fafce31e012dbdf:python/sglang/srt/models/llama.py @off 12000:
      set_eagle3_layers_to_capture: None -> [2, L//2, L-3], else [id + 1 for id in ids]; layer i in them
      appends hidden_states + residual before layer i runs (= HF hidden_states[i]).
    """
    out = Loaded(norm_before_residual=False)
    params = {f"model.midlayer.{p}" for p in _LAYER_PARAMS} | {"model.fc.weight", "model.norm.weight", "lm_head.weight",
                                                               "model.embed_tokens.weight"}
    for name in names:
        if "t2d" in name:
            out.dropped.append(name)
            continue
        if name == "d2t":
            out.params["hot_token_id"] = [name]
            continue
        mapped = _stack(name if name in params else "model." + name)
        if mapped in params:
            out.params.setdefault(mapped, []).append(name)
        else:
            out.dropped.append(name)
    if config.get("draft_vocab_size") is None:
        out.lm_head = "target"
    else:
        out.lm_head = "draft" if "lm_head.weight" in out.params else "uninitialised"
    out.d2t = "stored" if "hot_token_id" in out.params else "identity"
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    out.capture = (2, num_layers // 2, num_layers - 3) if ids is None else tuple(i + 1 for i in ids)
    return out
