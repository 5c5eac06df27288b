"""``train.compile``: each head's named parts through torch.compile give the eager loss and gradients, on packed
and padded batches of different lengths (dynamic shapes), and a compiled run trains as the eager one does."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters
from trainer_fixtures import make_setup

from headstart.models.train_compile import compile_parts
from headstart.trainer.batches import collate
from headstart.trainer.config import load_config
from headstart.trainer.run import build_trainer


def _loss_and_grads(head, f):
    head.zero_grad(set_to_none=True)
    loss, metrics = head.loss(f)
    loss.backward()
    return loss.detach(), metrics, {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("head_name", ["eagle3", pytest.param("medusa", marks=pytest.mark.nightly),
                                       pytest.param("mtp", marks=pytest.mark.nightly)])
def test_compiled_parts_give_the_eager_loss_and_gradients(tmp_path, head_name):
    trainer = build_trainer(load_config(None, make_setup(tmp_path, head=head_name)))
    head = trainer.backend.module
    batches = [collate(trainer.train_data, [0, 1, 2, 3, 4], pack_tokens=120), collate(trainer.train_data, [5, 6, 7])]
    features = [trainer.features(b) for b in batches]
    assert features[0].input_ids.shape[1] != features[1].input_ids.shape[1]  # two lengths: one dynamic compile
    eager = [_loss_and_grads(head, f) for f in features]
    torch._dynamo.reset()
    counters.clear()
    done = compile_parts(head, type(head).compiled)
    assert done and set(done) <= set(type(head).compiled)
    compiled = [_loss_and_grads(head, f) for f in features]
    assert counters["stats"]["unique_graphs"] >= len(done)  # the parts really ran compiled
    for (l1, m1, g1), (l2, m2, g2) in zip(eager, compiled):
        torch.testing.assert_close(l2, l1, atol=1e-5, rtol=1e-5)
        assert {k: v for k, v in m1.items() if "correct" in k} == {k: v for k, v in m2.items() if "correct" in k}
        assert g1.keys() == g2.keys() and g1
        for name in g1:
            torch.testing.assert_close(g2[name], g1[name], atol=1e-5, rtol=1e-4, msg=name)
    # Parameter names (what checkpoints and exports read) are the eager head's.
    assert all("_orig_mod" not in n for n, _ in head.named_parameters())
    # A copy (the decode evaluation's, a user's) runs its own weights, not this head's; compiling again is a no-op.
    twin = copy.deepcopy(head)
    for path in done:
        *parents, leaf = path.split(".")
        owner, twin_owner = head, twin
        for part in parents:
            owner, twin_owner = getattr(owner, part), getattr(twin_owner, part)
        method = getattr(twin_owner, leaf)
        if not isinstance(method, torch.nn.Module):
            assert method.__self__ is twin_owner and getattr(owner, leaf).__self__ is owner, path
    assert compile_parts(head, type(head).compiled) == done and counters["stats"]["unique_graphs"] >= len(done)


def test_every_layer_of_a_multi_layer_draft_compiles_and_gives_the_eager_loss():
    """``layers.*.finish``: each later layer's parts compile (written out by name); a one-layer head has none."""
    from tiny_models import tiny_causal_lm

    from headstart.heads.eagle3.module import Eagle3Config, Eagle3Draft
    from headstart.models.head import Features

    model = tiny_causal_lm("llama", num_hidden_layers=8)
    torch.manual_seed(0)
    head = Eagle3Draft(Eagle3Config.from_target(model.config, draft_vocab_size=48, num_layers=3), ttt_steps=3)
    ids = torch.randint(3, 128, (1, 12))
    f = Features(input_ids=ids, loss_mask=torch.ones_like(ids), aux_hidden_states=torch.randn(1, 12, 3 * 32),
                 target_logits=torch.randn(1, 12, 48), target_in_draft=torch.ones(1, 12, dtype=torch.bool))
    eager = _loss_and_grads(head, f)
    torch._dynamo.reset()
    done = compile_parts(head, type(head).compiled, backend="eager")
    assert {f"layers.{i}.{part}" for i in (1, 2) for part in ("attn_input", "self_attn.qkv", "finish")} <= set(done)
    compiled = _loss_and_grads(head, f)
    torch.testing.assert_close(compiled[0], eager[0])
    assert compiled[2].keys() == eager[2].keys() and any(k.startswith("layers.2.") for k in eager[2])
    one = Eagle3Draft(Eagle3Config.from_target(model.config, draft_vocab_size=48), ttt_steps=3)
    assert not any(p.startswith("layers.") for p in compile_parts(one, type(one).compiled, backend="eager"))
    with pytest.raises(ValueError, match="'\\*' follows no module list"):
        compile_parts(head, ["midlayer.*.finish"])


def test_a_path_through_no_module_or_naming_nothing_is_refused(tmp_path):
    trainer = build_trainer(load_config(None, make_setup(tmp_path)))
    head = trainer.backend.module
    with pytest.raises(ValueError, match="'nothing' is not a module of the head"):
        compile_parts(head, ["nothing.finish"])
    with pytest.raises(ValueError, match="names no part of this head"):
        compile_parts(head, ["midlayer.no_such_part"])
    with pytest.raises(TypeError, match="neither a module nor a method"):
        compile_parts(head, ["midlayer.self_attn.block"])  # an int


def test_a_compiled_run_trains_as_the_eager_one(tmp_path):
    overrides = make_setup(tmp_path) + ["--train.max_steps=2", "--train.decode_eval_prompts=1",
                                        "--train.decode_eval_max_new_tokens=8"]
    eager = build_trainer(load_config(None, [*overrides, f"--output_dir={tmp_path / 'eager'}"]))
    torch._dynamo.reset()
    counters.clear()
    compiled = build_trainer(load_config(None, [*overrides, f"--output_dir={tmp_path / 'compiled'}", "--train.compile=true"]))
    head = compiled.backend.module
    assert hasattr(head.midlayer.finish.__func__, "_torchdynamo_orig_callable")  # the recipe's parts, compiled
    assert "finish" not in vars(compiled.decode_eval.head.midlayer)  # the evaluation's copy was taken before: eager
    for _ in range(2):
        a, b = eager.train_step(), compiled.train_step()
        eager.step += 1
        compiled.step += 1
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    assert counters["stats"]["unique_graphs"] >= 4  # the compiled parts ran
    assert compiled.decode_eval(compiled.backend.full_state_dict())["decode_tau"] >= 1.0


def test_compile_is_refused_with_deepspeed(tmp_path):
    overrides = make_setup(tmp_path) + ["--train.compile=true", "--parallel.backend=deepspeed"]
    with pytest.raises(ValueError, match="train.compile runs with parallel.backend=fsdp"):
        build_trainer(load_config(None, overrides))
