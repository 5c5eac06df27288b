"""Read a headstart export with vLLM's ``speculators`` package and run its forward pass.

Runs inside the speculators virtual environment (tests/speculators_env.py builds it): it imports
speculators, torch and safetensors only, never headstart. Called as

    python speculators_reader.py request.json

request: {"kind": "eagle3" | "peagle" | "mtp", "head": dir, "verifier": target dir, "inputs": .safetensors,
          "steps": k, "out": .safetensors, "report": .json}
inputs:  eagle3, peagle: aux [1, T, n*H] (the target's aux hidden states), input_ids [1, T] (token t+1 at t)
         mtp:    hidden [1, T, H] (the target's final hidden state), input_ids [1, T] (the tokens)
out:     logits_{j} [1, T', V_d] for each step j (P-EAGLE: depth j at anchors 0..T-1-j), from speculators' own model class
report:  what speculators loaded: its class, missing / unexpected tensors, the config it parsed.
"""

from __future__ import annotations

import json
import sys

import torch
from safetensors.torch import load_file, save_file


def _loading_report(model, checkpoint: str) -> dict:
    """Which stored tensors the model class has no place for (servers drop them silently), which of
    its tensors the checkpoint lacks, and which stayed NaN (speculators' mark of 'never loaded')."""
    from safetensors import safe_open

    with safe_open(checkpoint, framework="pt") as f:
        stored = set(f.keys())
    state = model.state_dict()
    return {
        "class": type(model).__name__,
        "stored": sorted(stored),
        "unexpected": sorted(stored - set(state)),
        "not_in_checkpoint": sorted(set(state) - stored),
        "nan": sorted(k for k, v in state.items() if v.is_floating_point() and bool(v.isnan().any())),
    }


def _capture_lm_head(model) -> list[torch.Tensor]:
    # speculators' forward returns argmax tokens (EAGLE-3) or logits (MTP); the lm_head's outputs,
    # one per step, are the draft logits either way.
    outputs: list[torch.Tensor] = []
    model.lm_head.register_forward_hook(lambda _m, _i, out: outputs.append(out.detach().float()))
    return outputs


def read_eagle3(req: dict, inputs: dict) -> tuple[dict, dict]:
    from speculators.models.eagle3 import Eagle3DraftModel

    head = req["head"]
    if "speculators_model_type" not in json.loads(open(head + "/config.json").read()):
        # The flat layout: converted the way a user would (`speculators convert --algorithm eagle3`).
        from speculators.convert.eagle.eagle3_converter import Eagle3Converter

        Eagle3Converter().convert(head, req["out"] + ".converted", base_model=req["verifier"], validate=False)
        head = req["out"] + ".converted"
    model = Eagle3DraftModel.from_pretrained(head, verifier=req["verifier"])
    # A head without embed_tokens (H == H_t) uses the target's, as vLLM and SGLang do. speculators 0.9.0
    # on transformers 5.19 leaves the embedding zero (not its NaN sentinel), so its loader skips the
    # verifier's: record that, then load the verifier's embedding with speculators' own loader.
    embed_zero = bool((model.embed_tokens.weight == 0).all())
    model = model.float().eval()  # before the verifier's embedding goes in, so it is not rounded to bf16
    model._load_verifier_weights(overwrite_embed_tokens=True)
    logits = _capture_lm_head(model)
    T = inputs["input_ids"].shape[1]
    with torch.no_grad():
        model(hidden_states=inputs["aux"].float(), input_ids=inputs["input_ids"].long(),
              document_ids=torch.zeros(1, T, dtype=torch.long), position_ids=torch.arange(T).unsqueeze(0),
              ttt_steps=req["steps"])
    c = model.config
    report = {
        **_loading_report(model, head + "/model.safetensors"),
        "embed_zero_after_load": embed_zero,
        "aux_layer_ids": list(c.eagle_aux_hidden_state_layer_ids or []),
        "draft_vocab_size": c.draft_vocab_size,
        "norm_before_residual": c.norm_before_residual,
        "fc_norm": getattr(c, "fc_norm", None),
        "norm_output": getattr(c, "norm_output", None),
        "target_hidden_size": c.target_hidden_size,
        "verifier": c.speculators_config.verifier.name_or_path,
        "speculative_tokens": c.speculators_config.proposal_methods[0].speculative_tokens,
        "d2t_sum": int(model.d2t.sum()),
        "t2d_sum": int(model.t2d.sum()),
    }
    return {f"logits_{j}": x for j, x in enumerate(logits)}, report


def read_peagle(req: dict, inputs: dict) -> tuple[dict, dict]:
    """speculators' P-EAGLE training forward with its anchor sampling made deterministic: depth d at every anchor
    0..T-1-d (COD sampling keeps a random share of them; which ones does not change an element's logits)."""
    import speculators.models.peagle.core as core
    from speculators.models.peagle import PEagleDraftModel

    T, K = inputs["input_ids"].shape[1], req["steps"]

    def every_anchor(seq_length, loss_mask, num_depths=8, **_):
        anchors = [torch.arange(seq_length - d) for d in range(num_depths)]
        return torch.cat(anchors), torch.cat([torch.full((len(a),), d) for d, a in enumerate(anchors)])

    core.generate_cod_sample_indices = every_anchor
    core.compute_metrics = lambda **_: (torch.zeros(()), {})  # its loss needs Triton's fused kernels; the logits do not
    model = PEagleDraftModel.from_pretrained(req["head"], verifier=req["verifier"]).float().eval()
    model._load_verifier_weights(overwrite_embed_tokens=True)
    logits = _capture_lm_head(model)
    with torch.no_grad():
        model(hidden_states=inputs["aux"].float(), input_ids=inputs["input_ids"].long(),
              document_ids=torch.zeros(1, T, dtype=torch.long), position_ids=torch.arange(T).unsqueeze(0),
              verifier_last_hidden_states=torch.zeros(1, T, model.config.transformer_layer_config.hidden_size),
              num_depths=K)
    flat = logits[0][0]  # [sum_d (T - d), V_d], depth-major
    sizes = [T - d for d in range(K)]
    report = {**_loading_report(model, req["head"] + "/model.safetensors"),
              "mask_token_id": model.mask_token_id, "fc_norm": getattr(model.config, "fc_norm", None),
              "aux_layer_ids": list(model.config.eagle_aux_hidden_state_layer_ids or []),
              "speculative_tokens": model.config.speculators_config.proposal_methods[0].speculative_tokens}
    return {f"logits_{d}": x.unsqueeze(0) for d, x in enumerate(flat.split(sizes))}, report


def read_mtp(req: dict, inputs: dict) -> tuple[dict, dict]:
    from speculators.convert.mtp.converter import MTPConverter
    from speculators.models.mtp import MTPDraftModel

    converted = req["out"] + ".converted"
    MTPConverter().convert(req["head"], converted, base_model=req["verifier"], num_speculative_steps=req["steps"],
                           validate=False)
    model = MTPDraftModel.from_pretrained(converted).float().eval()
    with torch.no_grad():
        logits, _, _ = model(input_ids=inputs["input_ids"].long(), hidden_states=inputs["hidden"].float())
    report = {
        **_loading_report(model, converted + "/model.safetensors"),
        "layer_type": type(model.mtp_layers[0]).__name__,
        "num_speculative_steps": model.config.num_speculative_steps,
    }
    return {f"logits_{j}": x.float() for j, x in enumerate(logits)}, report


def main() -> None:
    req = json.loads(open(sys.argv[1]).read())
    inputs = load_file(req["inputs"])
    logits, report = {"eagle3": read_eagle3, "peagle": read_peagle, "mtp": read_mtp}[req["kind"]](req, inputs)
    save_file({k: v.contiguous() for k, v in logits.items()}, req["out"])
    with open(req["report"], "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
