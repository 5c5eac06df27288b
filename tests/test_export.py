"""Exports: the speculators layout and the flat one convert into each other without loss; every
export records its target and is refused, by name, on another one."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import random_eagle3_head, tiny_causal_lm

from headstart.heads.eagle3.module import Eagle3Config, Eagle3Draft
from headstart.heads.exports import convert_head
from headstart.models.export import export_head, layouts_for
from headstart.models.head import DEFAULT_SPECULATIVE_TOKENS
from headstart.heads.medusa.module import MedusaConfig, MedusaHeads
from headstart.models.provenance import OtherTargetError, fingerprint, read_provenance
from headstart.heads.registry import load_head
from headstart.models.target import Target, TargetConfig


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """A Llama target and a Qwen3 target of the same shapes (the new user's mix-up), saved with tokenizers."""
    from conftest import CHATML_TEMPLATE, LLAMA3_TEMPLATE, make_tokenizer

    out = {}
    for family, template, eos in (("llama", LLAMA3_TEMPLATE, "<|eot_id|>"), ("qwen3", CHATML_TEMPLATE, "<|im_end|>")):
        root = tmp_path_factory.mktemp(family)
        tiny_causal_lm(family, num_hidden_layers=8, head_dim=8).save_pretrained(root)
        make_tokenizer(template, eos).save_pretrained(root)
        out[family] = root
    return out


def llama(targets) -> Target:
    return Target.from_pretrained(TargetConfig(path=str(targets["llama"]), dtype="float32"))


def tensors_and_config(directory):
    return load_file(str(directory / "model.safetensors")), json.loads((directory / "config.json").read_text())


def test_flat_and_speculators_layouts_round_trip_without_loss(tmp_path, targets):
    target = llama(targets)
    head = random_eagle3_head(target, counts_seed=0)
    export_head(head, tmp_path / "flat", "eagle3", fingerprint(targets["llama"]))
    flat_tensors, flat_config = tensors_and_config(tmp_path / "flat")
    assert "midlayer.self_attn.q_proj.weight" in flat_tensors and "embed_tokens.weight" not in flat_tensors

    convert_head(tmp_path / "flat", tmp_path / "spec", "speculators")
    spec_tensors, spec_config = tensors_and_config(tmp_path / "spec")
    assert set(spec_tensors) == {k.replace("midlayer.", "layers.0.") for k in flat_tensors}
    for k, v in flat_tensors.items():
        w = spec_tensors[k.replace("midlayer.", "layers.0.")]
        assert w.dtype == v.dtype and torch.equal(w, v), k
    # what vLLM and speculators read, all written explicitly (absent, each falls back silently)
    assert spec_config["speculators_model_type"] == "eagle3" and spec_config["architectures"] == ["Eagle3DraftModel"]
    assert spec_config["eagle_aux_hidden_state_layer_ids"] == list(head.config.aux_layer_ids)
    assert spec_config["norm_before_residual"] is False and spec_config["draft_vocab_size"] == 48
    assert spec_config["target_hidden_size"] == 32
    layer = spec_config["transformer_layer_config"]
    assert layer["num_hidden_layers"] == 1 and layer["vocab_size"] == 128 and layer["model_type"] == "llama"
    verifier = spec_config["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": str(targets["llama"]), "architectures": ["LlamaForCausalLM"]}
    assert spec_config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == DEFAULT_SPECULATIVE_TOKENS
    assert read_provenance(tmp_path / "spec")["layout"] == "speculators"
    assert read_provenance(tmp_path / "spec")["target"] == read_provenance(tmp_path / "flat")["target"]

    convert_head(tmp_path / "spec", tmp_path / "flat2", "flat")
    again_tensors, again_config = tensors_and_config(tmp_path / "flat2")
    assert again_config == flat_config
    assert set(again_tensors) == set(flat_tensors)
    assert all(torch.equal(again_tensors[k], v) and again_tensors[k].dtype == v.dtype for k, v in flat_tensors.items())
    convert_head(tmp_path / "flat2", tmp_path / "spec2", "speculators")
    assert tensors_and_config(tmp_path / "spec2")[1] == spec_config

    # both layouts load into the same head
    a, b = Eagle3Draft.load(tmp_path / "flat", target), Eagle3Draft.load(tmp_path / "spec", target)
    assert a.config == b.config
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_rope_scaling_survives_the_speculators_layout():
    config = Eagle3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                          vocab_size=128, draft_vocab_size=48, target_hidden_size=32, aux_layer_ids=(1, 3, 5),
                          target_num_layers=8, rope_theta=500000.0, max_position_embeddings=131072,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                          speculative_tokens=5)
    from headstart.heads.eagle3.speculators import flat_from_speculators, to_speculators_config

    d = to_speculators_config(config.to_hf_dict(), {"name_or_path": "meta-llama/Llama-3.1-8B-Instruct", "architectures": ["X"]})
    assert d["speculators_config"]["verifier"]["name_or_path"] == "meta-llama/Llama-3.1-8B-Instruct"  # not a local path
    assert d["transformer_layer_config"]["rope_parameters"]["rope_type"] == "llama3"
    assert Eagle3Config.from_hf_dict(flat_from_speculators(d)) == config


def test_speculators_configs_that_headstart_cannot_run_are_refused_by_key(tmp_path, targets):
    head = random_eagle3_head(llama(targets), counts_seed=0)
    with pytest.raises(ValueError, match="vLLM refuses it without one"):  # a speculators config names its target
        export_head(head, tmp_path / "h", "eagle3", None, "speculators")
    assert not (tmp_path / "h").exists()
    export_head(head, tmp_path / "h", "eagle3", fingerprint(targets["llama"]), "speculators")
    d = json.loads((tmp_path / "h" / "config.json").read_text())
    for key, value, message in (("eagle_aux_hidden_state_layer_ids", None, "eagle_aux_hidden_state_layer_ids is missing"),
                                ("norm_before_residual", True, "norm_before_residual is true or absent"),
                                ("norm_before_fc", True, "norm_before_fc is true"),
                                ("draft_vocab_size", None, "draft_vocab_size is missing")):
        broken = dict(d, **{key: value})
        (tmp_path / "h" / "config.json").write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=message):
            Eagle3Config.from_json(tmp_path / "h" / "config.json")
    del d["norm_before_residual"]  # absent means true on vLLM's speculators route
    (tmp_path / "h" / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="norm_before_residual is true or absent"):
        Eagle3Config.from_json(tmp_path / "h" / "config.json")


def test_export_format_both_writes_the_second_layout_beside_the_first(tmp_path, targets):
    head = random_eagle3_head(llama(targets), counts_seed=0)
    export_head(head, tmp_path / "final", "eagle3", fingerprint(targets["llama"]), "both")
    assert json.loads((tmp_path / "final" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert "speculators_model_type" in json.loads((tmp_path / "final" / "speculators" / "config.json").read_text())
    assert not (tmp_path / ".tmp-final").exists()
    assert layouts_for(head, "both") == ("flat", "speculators") and layouts_for(head, None) == ("flat",)
    medusa = MedusaHeads(MedusaConfig.from_target(llama(targets).config, 2, 1))
    with pytest.raises(ValueError, match=r"export.format 'speculators': MedusaHeads is exported in the layouts \['vllm'\]"):
        layouts_for(medusa, "speculators")


def test_a_head_is_refused_on_another_target_by_name_unless_allowed(tmp_path, targets):
    target = llama(targets)
    export_head(random_eagle3_head(target, counts_seed=0), tmp_path / "h", "eagle3", fingerprint(targets["llama"]))
    qwen = Target.from_pretrained(TargetConfig(path=str(targets["qwen3"]), dtype="float32"))
    assert qwen.config.hidden_size == target.config.hidden_size and qwen.vocab_size == target.vocab_size  # same shapes
    with pytest.raises(OtherTargetError, match=r"trained against .*llama.* \(LlamaForCausalLM\), but the target given is "
                                               r".*qwen3.* \(Qwen3ForCausalLM\): its config \(model_type llama vs qwen3\)"):
        load_head("eagle3", str(tmp_path / "h"), qwen)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_head("eagle3", str(tmp_path / "h"), qwen, allow_other_target=True)
    assert any("trained against" in str(w.message) for w in caught)
    assert isinstance(load_head("eagle3", str(tmp_path / "h"), target), Eagle3Draft)  # its own target: fine
    with pytest.raises(ValueError, match="holds a eagle3 head"):
        load_head("medusa", str(tmp_path / "h"), target)


def test_fingerprint_ignores_what_a_re_save_changes_and_sees_what_matters(tmp_path, targets):
    original = fingerprint(targets["llama"])
    d = json.loads((targets["llama"] / "config.json").read_text())
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in targets["llama"].iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    (copy / "config.json").write_text(json.dumps(dict(d, transformers_version="9.9.9", _name_or_path="/else", dtype="bfloat16")))
    assert fingerprint(copy)["config_sha256"] == original["config_sha256"]
    (copy / "config.json").write_text(json.dumps(dict(d, num_hidden_layers=7)))
    assert fingerprint(copy)["config_sha256"] != original["config_sha256"]


def test_export_head_script_converts_and_says_what_is_missing(tmp_path, targets, capsys):
    from headstart.scripts import export_head as script

    head = random_eagle3_head(llama(targets), counts_seed=0)
    export_head(head, tmp_path / "flat", "eagle3", None)  # a head that records no target
    assert script.main(["--head", str(tmp_path / "flat"), "--to", "speculators", "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert "vLLM refuses it without one: give the target's path" in err and not (tmp_path / "s").exists()
    assert script.main(["--head", str(tmp_path / "flat"), "--to", "speculators", "--out", str(tmp_path / "s"),
                        "--target", str(targets["llama"])]) == 0
    d = json.loads((tmp_path / "s" / "config.json").read_text())
    assert d["speculators_config"]["verifier"]["name_or_path"] == str(targets["llama"])
    assert script.main(["--head", str(tmp_path / "missing"), "--to", "flat", "--out", str(tmp_path / "f")]) == 2
    assert "--head " + str(tmp_path / "missing") + ": no such directory" in capsys.readouterr().err


def test_a_crash_while_replacing_an_export_never_loses_the_previous_one(tmp_path, targets, monkeypatch):
    head = random_eagle3_head(llama(targets), counts_seed=0)
    export_head(head, tmp_path / "final", "eagle3", None)
    before = (tmp_path / "final" / "model.safetensors").read_bytes()
    # killed between the two renames: the previous export sits at .old-final, final/ is gone
    (tmp_path / "final").rename(tmp_path / ".old-final")
    monkeypatch.setattr(Eagle3Draft, "save_pretrained", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        export_head(head, tmp_path / "final", "eagle3", None)
    assert (tmp_path / "final" / "model.safetensors").read_bytes() == before  # restored, and not overwritten


def test_converting_into_a_directory_that_holds_files_is_refused(tmp_path, targets):
    head = random_eagle3_head(llama(targets), counts_seed=0)
    export_head(head, tmp_path / "a", "eagle3", fingerprint(targets["llama"]))
    export_head(head, tmp_path / "b", "eagle3", fingerprint(targets["llama"]))
    with pytest.raises(ValueError, match="already holds files"):
        convert_head(tmp_path / "a", tmp_path / "b", "speculators")
    with pytest.raises(ValueError, match="inside"):
        convert_head(tmp_path / "a", tmp_path / "a" / "spec", "speculators")
    convert_head(tmp_path / "a", tmp_path / "b", "speculators", force=True)
    assert json.loads((tmp_path / "b" / "config.json").read_text())["speculators_model_type"] == "eagle3"
