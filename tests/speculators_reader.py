"""Read a headstart export with vLLM's ``speculators`` package and run its forward pass.

Runs inside the speculators virtual environment (tests/speculators_env.py builds it): it imports
speculators, torch and safetensors only, never headstart. Called as

    python speculators_reader.py request.json

request: {"kind": "eagle3" | "mtp", "head": dir, "verifier": target dir, "inputs": .safetensors,
          "steps": k, "out": .safetensors, "report": .json}
inputs:  eagle3: aux [1, T, n*H] (the target's aux hidden states), input_ids [1, T] (token t+1 at t)
         mtp:    hidden [1, T, H] (the target's final hidden state), input_ids [1, T] (the tokens)
out:     logits_{j} [1, T', V_d] for each step j, from speculators' own model class
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
    logits, report = {"eagle3": read_eagle3, "mtp": read_mtp}[req["kind"]](req, inputs)
    save_file({k: v.contiguous() for k, v in logits.items()}, req["out"])
    with open(req["report"], "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
