"""EAGLE-3.1: the EAGLE-3 head with its two norms on (``fc_norm``, ``norm_output``), as vLLM and speculators define
them -- the arithmetic, training and decoding agreeing, greedy-exact decoding, both export layouts carrying the
norms, and configs headstart cannot run refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import random_eagle3_head, tiny_causal_lm

from headstart.decode.generate import greedy_generate, speculative_generate
from headstart.decode.target_runner import TargetRunner
from headstart.heads.eagle3.drafter import Eagle3Drafter
from headstart.heads.eagle3.config import Eagle3Config, Eagle3Options
from headstart.heads.eagle3.module import Eagle3Draft, build_eagle3
from headstart.models.head import DraftConfig, Features
from headstart.models.target import Target


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return Target(tiny_causal_lm("llama", num_hidden_layers=8))


def randomized(head: Eagle3Draft, seed: int = 1) -> Eagle3Draft:
    """Random weights, the norms' too (a norm left at ones hides a norm applied in the wrong place)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.requires_grad:
                p.normal_(1.0 if "norm" in name else 0.0, 0.3 if "norm" in name else 0.2, generator=g)
    return head


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def features(target: Target, T: int = 14, seed: int = 6) -> tuple[torch.Tensor, object, Features]:
    ids = torch.randint(3, 128, (1, T), generator=torch.Generator().manual_seed(seed))
    out = target(ids)
    return ids, out, Features(input_ids=ids, loss_mask=torch.ones_like(ids), aux_hidden_states=out.aux_hidden_states,
                              target_logits=torch.zeros(1, T, 48), target_in_draft=torch.ones(1, T, dtype=torch.bool))


def test_fc_norm_normalises_each_target_layers_feature_before_fc(target):
    head = randomized(random_eagle3_head(target, fc_norm=True))
    assert [tuple(n.weight.shape) for n in head.fc_norm] == [(target.config.hidden_size,)] * 3
    _, out, _ = features(target)
    aux = out.aux_hidden_states
    eps = head.config.rms_norm_eps
    chunks = aux.chunk(3, dim=-1)
    want = torch.cat([rms(c, n.weight, eps) for c, n in zip(chunks, head.fc_norm)], dim=-1) @ head.fc.weight.T
    torch.testing.assert_close(head.project(aux), want, rtol=1e-5, atol=1e-5)
    plain = random_eagle3_head(target)
    plain.load_state_dict({k: v for k, v in head.state_dict().items() if not k.startswith("fc_norm.")})
    assert not torch.allclose(plain.project(aux), want, atol=1e-3)  # the norms change what fc reads


def test_norm_output_carries_the_final_normed_state_and_keeps_the_first_logits(target):
    """With ``norm_output`` a step's state is norm(layer output): step 0's logits are EAGLE-3's (lm_head(norm(h)) either
    way), and step 1 -- which reads the carried state -- differs."""
    head31 = randomized(random_eagle3_head(target, norm_output=True, ttt_steps=2))
    head3 = random_eagle3_head(target, ttt_steps=2)
    head3.load_state_dict(head31.state_dict())
    _, _, f = features(target)
    with torch.no_grad():
        s3, s31 = list(head3.unroll_hidden(f)), list(head31.unroll_hidden(f))
        torch.testing.assert_close(s31[0], head3.norm(s3[0]), rtol=1e-5, atol=1e-5)  # the carried state: normed
        l3, l31 = list(head3.unroll(f)), list(head31.unroll(f))
    torch.testing.assert_close(l31[0], l3[0], rtol=1e-5, atol=1e-5)
    assert (l31[1] - l3[1]).abs().max() > 1e-2


@pytest.mark.parametrize("fc_norm,norm_output", [(True, False), (False, True), (True, True)])
def test_drafter_steps_reproduce_the_ttt_logits_with_the_norms_on(target, fc_norm, norm_output):
    """Decoding runs what training runs: the drafter's step i at position t gives TTT step i's logits at t."""
    head = randomized(random_eagle3_head(target, fc_norm=fc_norm, norm_output=norm_output, ttt_steps=4))
    ids, out, f = features(target)
    with torch.no_grad():
        ttt = list(head.unroll(f))
    for t in (3, 9):
        drafter = Eagle3Drafter(head, 64)
        drafter.begin(ids[:, : t + 1], out.select(slice(0, t + 1)), int(ids[0, t + 1]))
        torch.testing.assert_close(drafter.last_logits[0].float(), ttt[0][0, t], rtol=1e-4, atol=1e-4)
        hidden = drafter.last_hidden
        for i in range(1, 4):
            hidden = drafter._step(hidden, ids[:, t + 1 + i].view(1, 1), drafter.length - 1 + i)
            torch.testing.assert_close(drafter._logits(hidden)[0, -1].float(), ttt[i][0, t], rtol=1e-4, atol=1e-4)


def test_eagle31_decoding_is_greedy_exact_in_chains_and_trees(target):
    from headstart.decode.tree import DynamicTree

    head = randomized(random_eagle3_head(target, fc_norm=True, norm_output=True))
    runner = TargetRunner(target, max_len=128)
    prompt = torch.randint(3, 128, (1, 11), generator=torch.Generator().manual_seed(5))
    plain = greedy_generate(runner, prompt, 30, set()).tokens
    for k in (1, 4):
        assert speculative_generate(runner, Eagle3Drafter(head, 128), prompt, 30, set(), k=k).tokens == plain
    tree = DynamicTree(depth=3, topk=2, total_tokens=6)
    assert speculative_generate(runner, Eagle3Drafter(head, 128), prompt, 30, set(), k=4, tree=tree).tokens == plain


@pytest.mark.parametrize("layout", ["flat", "speculators"])
def test_both_layouts_carry_the_norms_and_read_back_to_the_same_logits(target, tmp_path, layout):
    head = randomized(random_eagle3_head(target, fc_norm=True, norm_output=True, ttt_steps=3))
    head.save_pretrained(tmp_path, dtype=torch.float32, layout=layout,
                         verifier={"name_or_path": "some/target", "architectures": ["LlamaForCausalLM"]})
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True  # top-level keys in both layouts
    back = Eagle3Draft.from_pretrained(tmp_path, target_embeddings=target.embed_tokens.weight, ttt_steps=3)
    assert back.config.fc_norm and back.config.norm_output and back.config.variant == "EAGLE-3.1"
    _, _, f = features(target)
    with torch.no_grad():
        for got, want in zip(back.unroll(f), head.unroll(f)):
            torch.testing.assert_close(got, want)


def test_an_eagle3_export_read_as_eagle31_is_refused_for_missing_norms(target, tmp_path):
    """A config that switches fc_norm on over tensors without it is refused by tensor name (not a random norm)."""
    head = randomized(random_eagle3_head(target))
    head.save_pretrained(tmp_path, dtype=torch.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "fc_norm": True}))
    with pytest.raises(ValueError, match=r"missing \['fc_norm.0.weight', 'fc_norm.1.weight', 'fc_norm.2.weight'\]"):
        Eagle3Draft.from_pretrained(tmp_path, target_embeddings=target.embed_tokens.weight)


def test_norm_before_fc_is_refused_by_name_in_either_layout():
    flat = Eagle3Config.from_target(tiny_causal_lm("llama", num_hidden_layers=8).config, 48).to_hf_dict()
    with pytest.raises(ValueError, match="norm_before_fc is true"):
        Eagle3Config.from_hf_dict({**flat, "norm_before_fc": True})
    from headstart.heads.eagle3.speculators import flat_from_speculators, to_speculators_config

    spec = to_speculators_config(flat, {"name_or_path": "some/target", "architectures": []})
    with pytest.raises(ValueError, match="norm_before_fc is true"):
        flat_from_speculators({**spec, "norm_before_fc": True})


def test_recipe_fields_switch_the_norms_on_and_a_contradicting_config_file_is_refused(target, tmp_path):
    counts = torch.randint(0, 9, (target.vocab_size,), generator=torch.Generator().manual_seed(0))
    draft = DraftConfig(head="eagle3", options=Eagle3Options(draft_vocab_size=48, fc_norm=True, norm_output=True))
    head = build_eagle3(draft, target, counts)
    assert head.config.fc_norm and head.config.norm_output and len(head.fc_norm) == 3
    plain = Eagle3Config.from_target(target.config, 48, target.aux_layer_ids)
    (tmp_path / "draft.json").write_text(json.dumps(plain.to_hf_dict()))
    with pytest.raises(ValueError, match=r"draft.fc_norm, draft.norm_output is true but draft.config .* sets it false"):
        build_eagle3(DraftConfig(head="eagle3", config=str(tmp_path / "draft.json"), options=draft.options), target, counts)


def test_converting_a_flat_eagle31_export_to_speculators_keeps_its_norms(target, tmp_path):
    """What ``scripts/export_head.py --to speculators`` runs: the norm keys stay true and the fc_norm tensors move
    unchanged, and the result reads back to the same logits."""
    from safetensors.torch import load_file

    from headstart.heads.eagle3.convert import convert_eagle3

    head = randomized(random_eagle3_head(target, fc_norm=True, norm_output=True, ttt_steps=2))
    head.save_pretrained(tmp_path / "flat", dtype=torch.float32)
    convert_eagle3(tmp_path / "flat", tmp_path / "spec", "speculators",
                   verifier={"name_or_path": "some/target", "architectures": ["LlamaForCausalLM"]})
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["fc_norm"] is True and config["norm_output"] is True
    flat, spec = load_file(str(tmp_path / "flat" / "model.safetensors")), load_file(str(tmp_path / "spec" / "model.safetensors"))
    for i in range(3):
        torch.testing.assert_close(spec[f"fc_norm.{i}.weight"], flat[f"fc_norm.{i}.weight"])
    back = Eagle3Draft.from_pretrained(tmp_path / "spec", target_embeddings=target.embed_tokens.weight, ttt_steps=2)
    _, _, f = features(target)
    with torch.no_grad():
        for got, want in zip(back.unroll(f), head.unroll(f)):
            torch.testing.assert_close(got, want)


def test_make_draft_config_writes_an_eagle31_config(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(repo / "scripts/make_draft_config.py"), "--target", str(repo / "configs/demo/target"),
                          "--draft-vocab-size", "4096", "--eagle3.1", "--out", str(tmp_path / "d.json")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "EAGLE-3.1" in run.stdout
    config = Eagle3Config.from_json(tmp_path / "d.json")
    assert config.fc_norm and config.norm_output and config.draft_vocab_size == 4096
