"""Target capture equals ``output_hidden_states=True`` indexing, for every supported family."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import FAMILIES, tiny_causal_lm

from headstart.models.target import Target, TargetConfig, load_tokenizer


def test_default_ids_collide_on_a_shallow_target():
    # (2, L//2, L-3) = (2, 3, 3) for 6 layers: refused instead of silently feeding one layer twice.
    with pytest.raises(ValueError, match=r"strictly increasing, got \[2, 3, 3\]"):
        Target(tiny_causal_lm("llama"))


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_equals_hf_hidden_states(family):
    model = tiny_causal_lm(family, num_hidden_layers=8)
    target = Target(model)  # default ids (2, 4, 5)
    assert target.aux_layer_ids == (2, 4, 5)
    input_ids = torch.randint(0, 128, (2, 12))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0  # left padding on one row
    with torch.no_grad():
        ref = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    out = target(input_ids, attention_mask=attention_mask)
    expected = torch.cat([ref.hidden_states[k] for k in (2, 4, 5)], dim=-1)
    assert out.aux_hidden_states.shape == (2, 12, 3 * 32)
    assert torch.equal(out.aux_hidden_states, expected)
    assert torch.equal(out.last_hidden_state, ref.hidden_states[-1])
    # The next-token distribution recomputed from the last hidden state is the model's own.
    torch.testing.assert_close(target.logits(out.last_hidden_state), ref.logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(target.argmax(out.last_hidden_state, chunk_tokens=5), ref.logits.argmax(-1))
    from headstart.models import target as target_module

    # The default chunk follows the vocab: 2 positions x 128 entries per chunk here, 12 chunks, the same argmax.
    calls = []
    head = target.vocab_head()
    monkey = lambda h: calls.append(h.shape[0]) or head(h)  # noqa: E731
    old, target_module.ARGMAX_CHUNK_ENTRIES = target_module.ARGMAX_CHUNK_ENTRIES, 2 * target.vocab_size
    try:
        assert torch.equal(target_module.chunked_argmax(monkey, out.last_hidden_state, target.vocab_size), ref.logits.argmax(-1))
    finally:
        target_module.ARGMAX_CHUNK_ENTRIES = old
    assert calls == [2] * 12
    subset = torch.tensor([3, 17, 90])
    torch.testing.assert_close(target.logits(out.last_hidden_state, subset), ref.logits[..., subset], rtol=1e-5, atol=1e-5)


def test_target_is_frozen():
    target = Target(tiny_causal_lm("llama"), aux_layer_ids=(1, 2, 4))
    assert not any(p.requires_grad for p in target.parameters())
    assert not target.model.training


@pytest.mark.parametrize("ids, match", [((1, 2, 6), "out of range"), ((3, 2, 4), "strictly increasing"), ((), "empty")])
def test_bad_layer_ids(ids, match):
    with pytest.raises(ValueError, match=match):
        Target(tiny_causal_lm("llama"), aux_layer_ids=ids)


def test_from_pretrained_local_path(tmp_path):
    model = tiny_causal_lm("qwen3")
    model.save_pretrained(tmp_path / "qwen3")
    target = Target.from_pretrained(TargetConfig(path=str(tmp_path / "qwen3"), aux_layer_ids=(1, 3, 5), dtype="float32"))
    ids = torch.randint(0, 128, (1, 7))
    with torch.no_grad():
        ref = model(input_ids=ids, output_hidden_states=True)
    out = target(ids)
    torch.testing.assert_close(out.aux_hidden_states, torch.cat([ref.hidden_states[k] for k in (1, 3, 5)], -1))
    bf16 = Target.from_pretrained(TargetConfig(path=str(tmp_path / "qwen3"), aux_layer_ids=(1, 3, 5)))
    assert bf16(ids).aux_hidden_states.dtype == torch.bfloat16


def test_not_a_checkpoint_and_not_a_causal_lm(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        Target.from_pretrained(TargetConfig(path=str(tmp_path)))
    (tmp_path / "vit").mkdir()
    (tmp_path / "vit" / "config.json").write_text(json.dumps({"model_type": "vit", "architectures": ["ViTModel"]}))
    with pytest.raises(ValueError, match="not a causal LM"):
        Target.from_pretrained(TargetConfig(path=str(tmp_path / "vit")))
    with pytest.raises(FileNotFoundError, match="tokenizer directory not found"):
        load_tokenizer(str(tmp_path / "missing"))


def test_context_length_comes_from_the_config():
    """The decoder sizes its caches from this (the benchmark's old hard-coded 4096 was wrong both ways)."""
    from types import SimpleNamespace

    from headstart.models.target import context_length

    target = Target(tiny_causal_lm("llama", max_position_embeddings=777), aux_layer_ids=(1,))
    assert target.context_length == 777
    with pytest.raises(ValueError, match="no max_position_embeddings"):
        context_length(SimpleNamespace())
