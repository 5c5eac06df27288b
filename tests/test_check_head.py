"""scripts/check_head.py: each failure mode made by breaking a good export in one way."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import CHATML_TEMPLATE, LLAMA3_TEMPLATE, make_tokenizer
from safetensors.torch import load_file, save_file
from tiny_models import random_eagle3_head, tiny_causal_lm

from headstart.models.export import export_head
from headstart.models.provenance import fingerprint
from headstart.models.target import Target, TargetConfig
from headstart.scripts import check_head


DEMO = Path(__file__).parents[1] / "configs" / "demo"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("check")
    targets = {}
    for family, template, eos in (("llama", LLAMA3_TEMPLATE, "<|eot_id|>"), ("qwen3", CHATML_TEMPLATE, "<|im_end|>")):
        targets[family] = root / family
        tiny_causal_lm(family, num_hidden_layers=8, head_dim=8, max_position_embeddings=512).save_pretrained(targets[family])
        make_tokenizer(template, eos).save_pretrained(targets[family])
    target = Target.from_pretrained(TargetConfig(path=str(targets["llama"]), dtype="float32", aux_layer_ids=(1, 4, 6)))
    head = random_eagle3_head(target, counts_seed=0, aux_layer_ids=(1, 4, 6))
    export_head(head, root / "good", "eagle3", fingerprint(targets["llama"]), "both", )
    return root, targets


def broken(setup, tmp_path, layout: str = "flat", config=None, tensors=None) -> Path:
    """A copy of the good export (flat, or its speculators twin) with config.json / tensors changed."""
    root, _ = setup
    src = root / "good" if layout == "flat" else root / "good" / "speculators"
    out = tmp_path / "head"
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("speculators"))
    if config:
        d = json.loads((out / "config.json").read_text())
        config(d)
        (out / "config.json").write_text(json.dumps(d))
    if tensors:
        t = load_file(str(out / "model.safetensors"))
        tensors(t)
        save_file(t, str(out / "model.safetensors"))
    if config is None and tensors is None:  # the one case that breaks the file itself: cut it in half
        data = (out / "model.safetensors").read_bytes()
        (out / "model.safetensors").write_bytes(data[: len(data) // 2])
    return out


def problems_of(directory: Path, target: Path, capsys, *extra: str) -> tuple[int, list[str]]:
    code = check_head.main(["--head", str(directory), "--target", str(target), *extra])
    out = capsys.readouterr().out
    return code, [line.removeprefix("problem: ") for line in out.splitlines() if line.startswith("problem: ")]


def test_good_exports_in_both_layouts_pass(setup, capsys):
    root, targets = setup
    for directory in (root / "good", root / "good" / "speculators"):
        assert problems_of(directory, targets["llama"], capsys) == (0, [])


def test_a_speculators_head_with_midlayer_names_passes_as_vllm_maps_them(setup, tmp_path, capsys):
    _, targets = setup
    renamed = broken(setup, tmp_path, "speculators", None,
                     lambda t: t.update({k.replace("layers.0.", "midlayer."): t.pop(k) for k in list(t) if "layers.0." in k}))
    assert problems_of(renamed, targets["llama"], capsys) == (0, [])


def _set(key, value):
    return lambda d: d.__setitem__(key, value)


def _pop(key):
    return lambda t: t.pop(key)


CASES = {
    # name: (layout, config change, tensors change, the problem's file:key and words)
    "d2t dropped": ("flat", None, _pop("d2t"), "model.safetensors: d2t: missing: both servers then map draft id i"),
    "draft_vocab_size null": ("flat", _set("draft_vocab_size", None), None, "config.json: draft_vocab_size: missing or null"),
    "SGLang ids not shifted": ("flat", lambda d: d["eagle_config"].__setitem__("eagle_aux_hidden_state_layer_ids", [1, 4, 6]),
                               None, "eagle_config.eagle_aux_hidden_state_layer_ids: [1, 4, 6], but SGLang reads only this "
                                     "key and captures id + 1: for the vLLM ids [1, 4, 6] it must be [0, 3, 5]"),
    "vLLM ids null (speculators)": ("speculators", _set("eagle_aux_hidden_state_layer_ids", None), None,
                                    "eagle_aux_hidden_state_layer_ids: None: vLLM falls back to its default [2, 4, 5]"),
    "vLLM id out of range": ("flat", _set("eagle_aux_hidden_state_layer_ids", [1, 4, 8]), None,
                             "strictly increasing within [1, 7] for a target of 8 layers"),
    "lm_head of the target vocab": ("flat", None, lambda t: t.__setitem__("lm_head.weight", torch.zeros(128, 32)),
                                    "lm_head.weight: shape [128, 32], expected [48, 32]"),
    "lm_head dropped": ("flat", None, _pop("lm_head.weight"), "lm_head.weight: missing: vLLM then uses the target's"),
    "layers.0 names in the flat layout": (
        "flat", None, lambda t: t.update({k.replace("midlayer.", "layers.0."): t.pop(k) for k in list(t) if "midlayer." in k}),
        "layers.0.mlp.down_proj.weight: not a tensor of the flat EAGLE-3 layout: SGLang drops it silently (vLLM "
        "loads it; this layout names the decoder layer midlayer.*)"),
    "unknown tensor": ("flat", None, lambda t: t.__setitem__("midlayer.self_attn.q_norm.weight", t["norm.weight"].clone()),
                       "midlayer.self_attn.q_norm.weight: not a tensor of the flat EAGLE-3 layout: vLLM raises"),
    "a norm headstart does not have (speculators)": ("speculators", _set("norm_before_fc", True), None,
                                                     "config.json: norm_before_fc: true"),
    "a norm headstart does not have (flat)": ("flat", _set("norm_before_fc", True), None,
                                              "config.json: norm_before_fc: true"),
    "EAGLE-3.1's fc_norm on without its norms": ("flat", _set("fc_norm", True), None,
                                                 "model.safetensors: fc_norm.0.weight: missing"),
    "fc_norm tensors with fc_norm off": ("speculators", None,
                                         lambda t: t.__setitem__("fc_norm.0.weight", t["norm.weight"].clone()),
                                         "fc_norm.0.weight: not a tensor of the speculators EAGLE-3 layout: vLLM raises"),
    "architectures (flat)": ("flat", _set("architectures", ["LlamaForCausalLMEagle3", "X"]), None,
                             "architectures: ['LlamaForCausalLMEagle3', 'X']: the flat layout is exactly"),
    "aux ids not a list of ints": ("flat", _set("eagle_aux_hidden_state_layer_ids", ["1", "4"]), None,
                                   "eagle_aux_hidden_state_layer_ids: ['1', '4']: vLLM ids must be"),
    "truncated tensors": ("flat", None, None, "cannot be read"),
    "norm_before_residual absent (speculators)": ("speculators", lambda d: d.pop("norm_before_residual"), None,
                                                  "norm_before_residual: absent (true on this route)"),
    "max positions below the target's": ("flat", _set("max_position_embeddings", 256), None,
                                         "max_position_embeddings: 256 < the target's 512"),
    "rope theta": ("speculators", lambda d: d["transformer_layer_config"]["rope_parameters"].__setitem__("rope_theta", 5e5),
                   None, "transformer_layer_config.rope_theta: 500000.0 != the target's 10000.0"),
    "d2t as absolute ids": ("flat", None, lambda t: t.__setitem__("d2t", t["d2t"] + torch.arange(48)),
                            "model.safetensors: d2t: d2t maps outside the target vocab [0, 128)"),
    "t2d of another vocab": ("flat", None, lambda t: t.__setitem__("t2d", torch.roll(t["t2d"], 1)),
                             "model.safetensors: t2d: t2d must be true exactly at the ids d2t maps to"),
    "hidden size of another target": ("flat", _set("hidden_size", 48), None,
                                      "hidden_size: 48 != the target's hidden_size 32"),
    "no verifier (speculators)": ("speculators", lambda d: d["speculators_config"]["verifier"].__setitem__("name_or_path", None),
                                  None, "speculators_config.verifier.name_or_path: missing: vLLM refuses the config"),
    "mixed dtypes": ("flat", None, lambda t: t.__setitem__("norm.weight", t["norm.weight"].float()),
                     "model.safetensors: dtype: weights of mixed dtypes"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_broken_export_is_named_by_file_and_key(setup, tmp_path, capsys, case):
    _, targets = setup
    layout, config, tensors, expected = CASES[case]
    code, problems = problems_of(broken(setup, tmp_path, layout, config, tensors), targets["llama"], capsys)
    assert code == 1
    assert any(expected in p for p in problems), problems


def test_a_head_checked_against_another_target_is_a_problem_unless_allowed(setup, capsys):
    root, targets = setup
    code, problems = problems_of(root / "good", targets["qwen3"], capsys)
    assert code == 1
    assert any("headstart.json: target:" in p and "Qwen3ForCausalLM" in p and "its config (model_type llama vs qwen3)"
               in p for p in problems), problems
    assert problems_of(root / "good", targets["qwen3"], capsys, "--allow-other-target") == (0, [])
    check_head.main(["--head", str(root / "good"), "--target", str(targets["qwen3"]), "--allow-other-target"])
    assert "note: warning:" in capsys.readouterr().out  # allowed, but said


def test_an_export_without_its_record_says_the_target_was_not_verified(setup, tmp_path, capsys):
    root, targets = setup
    shutil.copytree(root / "good", tmp_path / "h", ignore=shutil.ignore_patterns("speculators", "headstart.json"))
    assert check_head.main(["--head", str(tmp_path / "h"), "--target", str(targets["llama"])]) == 0
    assert "the target was not verified" in capsys.readouterr().out


def test_medusa_and_mtp_exports_are_checked_by_their_loaders(capsys):
    assert problems_of(DEMO / "medusa-head", DEMO / "target", capsys)[0] == 0
    assert problems_of(DEMO / "mtp-head", DEMO / "target", capsys)[0] == 0


def test_medusa_of_the_wrong_width_is_refused(tmp_path, setup, capsys):
    _, targets = setup  # the demo Medusa heads are 256 wide, the tiny target 32
    code, problems = problems_of(DEMO / "medusa-head", targets["llama"], capsys, "--allow-other-target")
    assert code == 1 and any("hidden_size 256" in p for p in problems), problems


def test_questions_show_a_head_that_loads_but_accepts_nothing(tmp_path, capsys):
    """The demo head decodes with tau well above 1; the same head with its lm_head rows shuffled loads
    cleanly and passes every format check, and only decoding shows it accepts nothing."""
    questions = str(DEMO / "eval" / "mt_bench.jsonl")
    args = ["--questions", questions, "--limit", "2", "--max-new-tokens", "24"]
    code = check_head.main(["--head", str(DEMO / "eagle3-head"), "--target", str(DEMO / "target"), *args])
    out = capsys.readouterr().out
    tau = float(out.split("tau ")[1].split()[0])
    assert code == 0 and tau > 1.5, out
    shuffled = tmp_path / "shuffled"
    shutil.copytree(DEMO / "eagle3-head", shuffled)
    t = load_file(str(shuffled / "model.safetensors"))
    t["lm_head.weight"] = t["lm_head.weight"][torch.randperm(t["lm_head.weight"].shape[0], generator=torch.Generator().manual_seed(0))]
    save_file(t, str(shuffled / "model.safetensors"))
    code = check_head.main(["--head", str(shuffled), "--target", str(DEMO / "target"), *args])
    out = capsys.readouterr().out
    assert code == 1 and "accepts (almost) nothing" in out, out
