"""headstart's EAGLE-3 exports as vLLM's and SGLang's loaders read them (tests/server_loaders.py
models each loader from its source, cited there by repo, commit, file and line).

For a head trained on aux layers (1, 4, 6) of an 8-layer target -- not the servers' default
(2, 4, 5), so a silent fallback would show -- every exported tensor must land in a server
parameter (none dropped, none unknown), the draft's own lm_head and d2t must be used, the residual
convention must be headstart's (norm_before_residual false), and the target layers each server
captures must be exactly the HF hidden_states indices headstart trained on.
"""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open
from server_loaders import sglang_flat, vllm_flat, vllm_speculators_config
from tiny_models import random_eagle3_head, tiny_causal_lm

from headstart.models.head import DEFAULT_SPECULATIVE_TOKENS
from headstart.models.export import export_head
from headstart.models.provenance import fingerprint
from headstart.models.target import Target, TargetConfig

TRAINED_ON = (1, 4, 6)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("servers")
    tiny_causal_lm("llama", num_hidden_layers=8).save_pretrained(root / "target")
    target = Target.from_pretrained(TargetConfig(path=str(root / "target"), dtype="float32", aux_layer_ids=TRAINED_ON))
    export_head(random_eagle3_head(target, counts_seed=0, aux_layer_ids=TRAINED_ON), root / "final", "eagle3",
                fingerprint(root / "target"), "both")
    return root / "final"


def read(directory):
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    return json.loads((directory / "config.json").read_text()), names


def test_flat_export_as_vllm_and_sglang_load_it(exported):
    config, names = read(exported)
    for load in (vllm_flat, sglang_flat):
        loaded = load(config, names, num_layers=8)
        assert loaded.dropped == ["t2d"], load.__name__  # t2d is for training-side tools only
        assert sorted(n for group in loaded.params.values() for n in group) == sorted(set(names) - {"t2d"})
        assert loaded.lm_head == "draft" and loaded.d2t == "stored" and loaded.norm_before_residual is False
        assert loaded.capture == TRAINED_ON, load.__name__  # vLLM: top-level ids; SGLang: nested ids + 1
    # q/k/v and gate/up stack into the servers' fused parameters, all three of each present
    assert len(vllm_flat(config, names, 8).params["model.layers.0.self_attn.qkv_proj.weight"]) == 3
    assert len(sglang_flat(config, names, 8).params["model.midlayer.mlp.gate_up_proj.weight"]) == 2


def test_speculators_export_as_vllm_reads_its_config_and_tensors(exported):
    config, names = read(exported / "speculators")
    hf = vllm_speculators_config(config)
    assert hf["norm_before_residual"] is False  # absent would mean True on this route
    assert hf["eagle_aux_hidden_state_layer_ids"] == list(TRAINED_ON)
    assert hf["draft_vocab_size"] == 48 and hf["target_hidden_size"] == 32 and hf["num_hidden_layers"] == 1
    assert hf["num_lookahead_tokens"] == DEFAULT_SPECULATIVE_TOKENS and hf["target_model"].endswith("target")  # `vllm serve <head>` needs it
    without_verifier = json.loads(json.dumps(config))
    without_verifier["speculators_config"]["verifier"]["name_or_path"] = None
    with pytest.raises(ValueError, match="verifier"):
        vllm_speculators_config(without_verifier)
    loaded = vllm_flat(hf, names, num_layers=8)  # the same Eagle3LlamaForCausalLM then loads layers.0.* names
    assert loaded.dropped == ["t2d"] and loaded.capture == TRAINED_ON and loaded.lm_head == "draft"


def _variant(src, dst, config=None, rename=None, drop=()):
    """A copy of an export with config.json edited and tensors renamed or dropped."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("speculators"))
    d = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config(d) if config else d))
    t = {(rename(k) if rename else k): v for k, v in load_file(str(dst / "model.safetensors")).items() if k not in drop}
    save_file(t, str(dst / "model.safetensors"))
    return dst


SILENT = {
    # a mistake: (config edit, tensor rename, tensors dropped, what a server makes of it without an error)
    "speculators names in a flat directory": (
        None, lambda n: n.replace("midlayer.", "layers.0."), (),
        lambda c, n: len(sglang_flat(c, n, 8).dropped) == 1 + 10),  # t2d and the whole decoder layer
    "no top-level ids": (
        lambda d: {k: v for k, v in d.items() if k != "eagle_aux_hidden_state_layer_ids"}, None, (),
        lambda c, n: vllm_flat(c, n, 8).capture == (2, 4, 5)),
    "only top-level ids": (
        lambda d: dict(d, eagle_config={"use_aux_hidden_state": True}), None, (),
        lambda c, n: sglang_flat(c, n, 8).capture == (2, 4, 5)),
    "vLLM ids in SGLang's key": (
        lambda d: dict(d, eagle_config={"eagle_aux_hidden_state_layer_ids": list(TRAINED_ON)}), None, (),
        lambda c, n: sglang_flat(c, n, 8).capture == (2, 5, 7)),
    "no lm_head": (
        None, None, ("lm_head.weight",),
        lambda c, n: vllm_flat(c, n, 8).lm_head == "target" and sglang_flat(c, n, 8).lm_head == "uninitialised"),
    "no d2t": (
        None, None, ("d2t",), lambda c, n: vllm_flat(c, n, 8).d2t == "identity" and sglang_flat(c, n, 8).d2t == "identity"),
    "null draft_vocab_size": (
        lambda d: dict(d, draft_vocab_size=None), None, (), lambda c, n: sglang_flat(c, n, 8).lm_head == "target"),
}


@pytest.mark.parametrize("mistake", sorted(SILENT))
def test_what_a_server_gets_wrong_silently_check_head_reports(exported, tmp_path, mistake):
    """Each mistake passes a server's loader without an error (the loader model shows what it becomes),
    and scripts/check_head.py names it."""
    from headstart.heads.exports import check_head

    config_edit, rename, drop, silently = SILENT[mistake]
    variant = _variant(exported, tmp_path / "head", config_edit, rename, drop)
    config, names = read(variant)
    assert silently(config, names), mistake
    _, problems, _ = check_head(variant, exported.parent / "target")
    assert problems, f"check_head passed a head with {mistake}"


def test_vllm_refuses_what_sglang_drops_and_reads_norm_before_residual_as_true_when_absent(exported):
    config, names = read(exported)
    with pytest.raises(KeyError):
        vllm_flat(config, names + ["midlayer.self_attn.q_norm.weight"], 8)  # an unknown name: an error in vLLM
    assert sglang_flat(config, names + ["midlayer.self_attn.q_norm.weight"], 8).dropped[-1].endswith("q_norm.weight")
    spec, _ = read(exported / "speculators")
    assert vllm_speculators_config({k: v for k, v in spec.items() if k != "norm_before_residual"})["norm_before_residual"]
