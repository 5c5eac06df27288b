"""headstart's exports read back by vLLM's own format library, ``speculators`` 0.9.0.

speculators runs in its own virtual environment (tests/speculators_env.py: it pins older
transformers/datasets than headstart); tests/speculators_reader.py loads a head there with
speculators' model classes and runs their forward pass on inputs this test fixes. Checked: every
stored tensor has a place in speculators' model (vLLM raises on the others, SGLang drops them), no
parameter is left unloaded, the config is parsed to the values headstart trained with, and the
draft logits equal headstart's (float32 on both sides, weights exported in bf16 and upcast alike).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from speculators_env import speculators_python
from test_mtp import native_checkpoint
from tiny_models import random_eagle3_head, random_peagle_head, tiny_causal_lm

from headstart.models.export import export_head
from headstart.models.head import Features, shift_left
from headstart.heads.mtp.module import build_mtp
from headstart.models.provenance import fingerprint
from headstart.models.target import Target, TargetConfig

pytestmark = pytest.mark.slow
READER = __file__.replace("test_conformance.py", "speculators_reader.py")
T = 128  # speculators' flex-attention block mask is built in blocks of 128 positions
# float32 on both sides, the same operations in another order. Relative to the logits' scale: speculators'
# forward is not bitwise reproducible from run to run on CPU (the same request gave max |diff| 8.6e-4 on
# logits of max 6.5 once in 7 runs, at every position but the first, i.e. inside attention), while a
# swapped, dropped or misread tensor moves the logits by O(their scale).
TOLERANCE = 1e-3


def close(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, float]:
    diff = (got - want).abs().max().item()
    return diff < TOLERANCE * max(1.0, want.abs().max().item()), diff


def read_with_speculators(tmp_path, kind: str, head_dir, verifier, inputs: dict, steps: int):
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in inputs.items()}, str(tmp_path / f"{kind}-in.safetensors"))
    request = {"kind": kind, "head": str(head_dir), "verifier": str(verifier), "steps": steps,
               "inputs": str(tmp_path / f"{kind}-in.safetensors"), "out": str(tmp_path / f"{kind}-logits.safetensors"),
               "report": str(tmp_path / f"{kind}-report.json")}
    (tmp_path / f"{kind}-request.json").write_text(json.dumps(request))
    run = subprocess.run([str(speculators_python()), READER, str(tmp_path / f"{kind}-request.json")],
                         capture_output=True, text=True, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr[-4000:]
    return load_file(request["out"]), json.loads((tmp_path / f"{kind}-report.json").read_text())


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Random weights everywhere, norms included, so a swapped or dropped tensor shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.requires_grad:
                p.normal_(1.0 if "norm" in name else 0.0, 0.3 if "norm" in name else 0.1, generator=g)


@pytest.fixture(scope="module")
def llama_target(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama-target")
    tiny_causal_lm("llama", num_hidden_layers=8).save_pretrained(root)
    return root, Target.from_pretrained(TargetConfig(path=str(root), dtype="float32", aux_layer_ids=(1, 3, 6)))


@pytest.mark.parametrize("norms,num_layers", [(False, 1), (True, 1), (False, 2)],
                         ids=["eagle3", "eagle3.1", "eagle3-2-layers"])
def test_eagle3_exports_in_both_layouts_load_in_speculators_with_the_same_logits(tmp_path, llama_target, norms,
                                                                               num_layers):
    """EAGLE-3, EAGLE-3.1 (its fc_norm and norm_output on) and a two-layer draft: speculators' own model computes
    headstart's logits."""
    root, target = llama_target
    head = random_eagle3_head(target, draft_vocab_size=48, counts_seed=1, aux_layer_ids=target.aux_layer_ids,
                              fc_norm=norms, norm_output=norms, num_layers=num_layers)
    assert head.config.aux_layer_ids == (1, 3, 6)  # not the default [2, L//2, L-3] = [2, 4, 5]: a fallback would show
    randomize(head, seed=2)
    export_head(head, tmp_path / "final", "eagle3", fingerprint(root), "both")
    steps = 3
    torch.manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (1, T))
    with torch.no_grad():
        aux = target.model(ids, output_hidden_states=True).hidden_states
        aux = torch.cat([aux[i] for i in head.config.aux_layer_ids], dim=-1)
        # headstart reads its own export back (bf16 weights, like speculators) and unrolls the TTT steps
        mine = Target.from_pretrained(TargetConfig(path=str(root), dtype="float32", aux_layer_ids=(1, 3, 6)))
        ours = type(head).load(tmp_path / "final", mine).float()
        ours.ttt_steps = steps
        expected = list(ours.unroll(Features(input_ids=ids, loss_mask=torch.ones_like(ids), aux_hidden_states=aux)))
    inputs = {"aux": aux, "input_ids": shift_left(ids, 1, 0)}  # speculators' step 0 reads token t+1 at t
    layouts = [("speculators", tmp_path / "final" / "speculators"), ("flat", tmp_path / "final")]
    # speculators 0.9.0's converter of the flat layout loads the tensors into its legacy Eagle3Speculator, which has
    # no fc_norm, and drops them with a warning: an EAGLE-3.1 head reaches speculators in its own layout only
    # (docs/FORMATS.md). vLLM reads the flat layout's fc_norm itself. That legacy class has one layer, too.
    for layout, directory in layouts[:1] if norms or num_layers > 1 else layouts:
        logits, report = read_with_speculators(tmp_path / layout, "eagle3", directory, root, inputs, steps)
        assert report["class"] == "Eagle3DraftModel"
        assert report["unexpected"] == [], (layout, report["unexpected"])
        assert set(report["not_in_checkpoint"]) <= {"embed_tokens.weight", "verifier_lm_head.weight",
                                                    "verifier_norm.weight"}, report["not_in_checkpoint"]
        assert report["nan"] == []
        assert report["draft_vocab_size"] == 48 and report["norm_before_residual"] is False
        assert report["fc_norm"] is norms and report["norm_output"] is norms  # EAGLE-3.1's norms read as written
        assert report["d2t_sum"] == int(head.d2t.sum()) and report["t2d_sum"] == 48
        if layout == "speculators":  # written explicitly; the flat layout goes through speculators' converter
            assert report["aux_layer_ids"] == [1, 3, 6]
            assert report["verifier"] == str(root) and report["target_hidden_size"] == target.config.hidden_size
        for j in range(steps):
            valid = T - 1 - j  # the last positions read the padding token that shift_left put there
            got, want = logits[f"logits_{j}"][:, :valid], expected[j][:, :valid]
            assert got.shape == want.shape
            ok, diff = close(got, want)
            print(f"eagle3 {layout} layout, TTT step {j}: max |logit difference| {diff:.2e}")
            assert ok, (layout, j, diff)


@pytest.mark.parametrize("fc_norm,num_layers", [(False, 1), (True, 1), (False, 4)])
def test_peagle_export_loads_in_speculators_with_the_same_logits_at_every_depth(tmp_path, llama_target, fc_norm,
                                                                              num_layers):
    """P-EAGLE in the speculators layout: speculators' PEagleDraftModel places mask_hidden, the placeholder token and
    (with fc_norm) the norms where headstart does, and a 4-layer draft's layers (the paper's drafter) -- its training
    forward gives headstart's logits at every depth."""
    root, target = llama_target
    head = random_peagle_head(target, draft_vocab_size=48, parallel_tokens=3, mask_token_id=17, fc_norm=fc_norm,
                              aux_layer_ids=target.aux_layer_ids, num_layers=num_layers)
    randomize(head, seed=2)
    export_head(head, tmp_path / "final", "peagle", fingerprint(root), "both")
    torch.manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (1, T))
    with torch.no_grad():
        aux = target.model(ids, output_hidden_states=True).hidden_states
        aux = torch.cat([aux[i] for i in (1, 3, 6)], dim=-1)
        ours = type(head).load(tmp_path / "final", target).float()
        expected = list(ours.unroll(Features(input_ids=ids, loss_mask=torch.ones_like(ids), aux_hidden_states=aux)))
    inputs = {"aux": aux, "input_ids": shift_left(ids, 1, 0)}
    logits, report = read_with_speculators(tmp_path, "peagle", tmp_path / "final" / "speculators", root, inputs, 3)
    assert report["class"] == "PEagleDraftModel" and report["unexpected"] == [] and report["nan"] == []
    assert "mask_hidden" in report["stored"] and report["mask_token_id"] == 17 and report["fc_norm"] is fc_norm
    assert report["aux_layer_ids"] == [1, 3, 6]
    for d in range(3):
        valid = T - 1 - d  # the last anchors read the padding token that shift_left put there
        got, want = logits[f"logits_{d}"][:, :valid], expected[d][:, :valid]
        ok, diff = close(got, want)
        print(f"peagle fc_norm={fc_norm}, depth {d}: max |logit difference| {diff:.2e}")
        assert ok, (d, diff)


def test_mtp_export_of_a_qwen3_next_target_loads_in_speculators_with_the_same_first_step_logits(tmp_path):
    """speculators reads a Qwen3-Next target's ``mtp.*`` tensors through its own MTP converter."""
    src = tmp_path / "qwen3-next"
    native_checkpoint(src, "qwen3_next", shards=False)
    # bf16, as real targets ship: speculators loads the target's embedding and head into its bf16 model.
    tensors = load_file(str(src / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(src / "model.safetensors"), metadata={"format": "pt"})
    target = Target.from_pretrained(TargetConfig(path=str(src), dtype="float32"))
    head = build_mtp(target, unroll=2)
    randomize(head, seed=4)  # what training would have changed
    export_head(head, tmp_path / "final", "mtp", fingerprint(src))
    torch.manual_seed(0)
    n = 32
    ids = torch.randint(0, target.vocab_size, (1, n))
    with torch.no_grad():
        hidden = target.model(ids, output_hidden_states=True).hidden_states[-1]  # after the final norm
        mine = Target.from_pretrained(TargetConfig(path=str(tmp_path / "final"), dtype="float32"))
        ours = type(head).load(tmp_path / "final", mine).float()
        f = Features(input_ids=ids, loss_mask=torch.ones_like(ids), last_hidden_state=hidden)
        expected = [ours.logits(h) for h in ours.unroll(f)]
    logits, report = read_with_speculators(tmp_path, "mtp", tmp_path / "final", tmp_path / "final",
                                           {"hidden": hidden, "input_ids": ids}, steps=2)
    assert report["class"] == "MTPDraftModel" and report["layer_type"] == "Qwen3NextMTPLayer"
    # verifier_lm_head: speculators' converter stores the target's head for training; its MTP model drops it
    assert set(report["unexpected"]) <= {"verifier_lm_head.weight"} and report["nan"] == []
    assert set(report["not_in_checkpoint"]) <= {"embed_tokens.weight", "lm_head.weight"}, report["not_in_checkpoint"]
    valid = logits["logits_0"].shape[1]  # speculators scores the positions that have every step's target
    assert valid == n - 2 - 1
    # Every position of step 0, the first included: a Qwen3-Next MTP layer keeps position 0's embedding
    # (vLLM's qwen3_next_mtp.py; only DeepSeek's zeroes it). Later steps are not compared: speculators'
    # training forward keeps the positions and attends causally in every step, where vLLM's proposer
    # (and headstart) moves one position on per step and attends to the earlier steps' own keys.
    got, want = logits["logits_0"], expected[0][:, :valid]
    ok, diff = close(got, want)
    print(f"mtp qwen3_next layout, step 0: max |logit difference| {diff:.2e}")
    assert ok, diff


def test_the_committed_demo_head_converted_to_speculators_reads_the_same(tmp_path):
    """Real trained weights, the demo target in bf16 as shipped: the export a user would serve."""
    from headstart.heads.eagle3.module import Eagle3Draft
    from headstart.heads.exports import convert_head

    demo = Path(__file__).parents[1] / "configs" / "demo"
    convert_head(demo / "eagle3-head", tmp_path / "spec", "speculators", fingerprint(demo / "target"))
    target = Target.from_pretrained(TargetConfig(path=str(demo / "target"), dtype="float32"))
    head = Eagle3Draft.load(tmp_path / "spec", target).float()
    head.ttt_steps = steps = 4
    torch.manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (1, T))
    with torch.no_grad():
        aux = target(ids).aux_hidden_states
        expected = list(head.unroll(Features(input_ids=ids, loss_mask=torch.ones_like(ids), aux_hidden_states=aux)))
    logits, report = read_with_speculators(tmp_path, "eagle3", tmp_path / "spec", demo / "target",
                                           {"aux": aux, "input_ids": shift_left(ids, 1, 0)}, steps)
    assert report["unexpected"] == [] and report["nan"] == [] and report["aux_layer_ids"] == list(head.config.aux_layer_ids)
    for j in range(steps):
        ok, diff = close(logits[f"logits_{j}"][:, : T - 1 - j], expected[j][:, : T - 1 - j])
        print(f"demo eagle3 head, speculators layout, TTT step {j}: max |logit difference| {diff:.2e}")
        assert ok, (j, diff)
