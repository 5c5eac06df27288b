"""The distilled draft model: its loss against a dense reference for every divergence, the two initialisations, AdaSPEC's
filter, refusals by name, training through the shared trainer, and the export as a plain HF causal LM that the
``draft-model`` method decodes greedy-exact."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from tiny_models import random_features, tiny_causal_lm
from trainer_fixtures import make_setup, train_losses
from transformers import AutoModelForCausalLM

from headstart.decode.generate import greedy_generate, speculative_generate
from headstart.decode.target_runner import TargetRunner
from headstart.heads.draft_model.module import DraftModel, DraftModelOptions, build_draft_model
from headstart.heads.draft_model.selective import keep_learnable, token_divergences
from headstart.heads.draft_model.spec import DistilledDrafter
from headstart.heads.exports import check_head
from headstart.models.export import export_head
from headstart.models.head import DraftConfig, Features
from headstart.models.provenance import fingerprint
from headstart.models.target import Target, TargetConfig
from headstart.models.vocab_loss import divergence_rows
from headstart.trainer.config import load_config
from headstart.trainer.run import build_trainer


@pytest.fixture(scope="module")
def target_dir(llama8_dir):
    return llama8_dir


@pytest.fixture(scope="module")
def target(target_dir):
    return Target.from_pretrained(TargetConfig(path=str(target_dir), dtype="float32"))


def draft_for(target, loss="kl", seed=0, **options) -> DraftModel:
    head = build_draft_model(DraftConfig(head="draft_model", loss=loss, options=DraftModelOptions(**options)), target,
                             torch.ones(target.config.vocab_size))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # away from the target's own layers: the draft and the target disagree
        for p in head.model.model.layers.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return head


def batch(target, B=2, T=17, seed=1) -> Features:
    return random_features(target, B, T, seed, cut=12)


@pytest.mark.parametrize("loss", ["kl", "rkl", "tv"])
def test_loss_equals_a_dense_reference(target, loss):
    head = draft_for(target, loss=loss)
    f = batch(target)
    got, metrics = head.loss(f)
    logq = F.log_softmax(head.model(f.input_ids).logits.float(), -1)  # [B, T, V]: position t predicts token t+1
    logp = F.log_softmax(target.logits(f.last_hidden_state).float(), -1)
    p, q = logp.exp(), logq.exp()
    dense = {"kl": -(p * logq).sum(-1), "rkl": (q * (logq - logp)).sum(-1), "tv": 0.5 * (p - q).abs().sum(-1)}[loss]
    # Trained: token t+1 an assistant token, for t >= 1 (the draft's state at t predicts t+1; a sequence's second
    # token, never an assistant's, is not), over every head's denominator: the trained tokens after the first.
    trained = f.loss_mask[:, 2:].bool()
    want = dense[:, 1:-1][trained].sum() / f.loss_mask[:, 1:].sum()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    right = (logq.argmax(-1) == logp.argmax(-1))[:, 1:-1][trained]
    assert metrics["acc_0"] == pytest.approx(right.float().mean().item())
    assert metrics["sim_accept_len"] == pytest.approx(1 + right.float().mean().item())


def test_data_labels_are_cross_entropy_to_the_next_token(target):
    head = draft_for(target, labels="data")
    f = batch(target)
    got, _ = head.loss(f)
    logq = F.log_softmax(head.model(f.input_ids).logits.float(), -1)
    trained = f.loss_mask[:, 2:].bool()
    nll = -logq[:, 1:-1].gather(-1, f.input_ids[:, 2:, None]).squeeze(-1)
    torch.testing.assert_close(got, nll[trained].sum() / f.loss_mask[:, 1:].sum(), atol=1e-5, rtol=1e-5)


def test_target_init_is_the_targets_first_layers_and_fresh_is_not(target):
    head = build_draft_model(DraftConfig(head="draft_model", options=DraftModelOptions(num_layers=2)), target,
                             torch.ones(target.config.vocab_size))
    want = target.model.state_dict()
    got = head.model.state_dict()
    assert head.model.config.num_hidden_layers == 2
    assert sorted(k for k in got if ".layers." in k) == sorted(k for k in want if ".layers.0." in k or ".layers.1." in k)
    assert all(torch.equal(got[k], want[k]) for k in got)  # embeddings, layers 0-1, final norm, lm_head
    whole = build_draft_model(DraftConfig(head="draft_model", options=DraftModelOptions(num_layers=8)), target,
                              torch.ones(target.config.vocab_size))  # all 8 layers: the target itself
    ids = torch.randint(3, 128, (1, 9))
    torch.testing.assert_close(whole.model(ids).logits, target.model(ids).logits)
    fresh = build_draft_model(DraftConfig(head="draft_model", options=DraftModelOptions(num_layers=2, init="fresh")),
                              target, torch.ones(target.config.vocab_size))
    assert not torch.equal(fresh.model.state_dict()["model.layers.0.mlp.up_proj.weight"],
                           want["model.layers.0.mlp.up_proj.weight"])


def test_bad_configs_are_refused_by_name(target, tmp_path):
    with pytest.raises(ValueError, match="draft.init must be 'target' or 'fresh'"):
        DraftModelOptions(init="random")
    with pytest.raises(ValueError, match="draft.filter_keep must be in"):
        DraftModelOptions(filter_keep=0.0)
    with pytest.raises(ValueError, match="draft.config gives a fresh draft model's shape"):
        build_draft_model(DraftConfig(head="draft_model", config="x.json", options=DraftModelOptions()), target,
                          torch.ones(128))
    with pytest.raises(ValueError, match="needs draft.labels=target"):
        build_draft_model(DraftConfig(head="draft_model", loss="rkl", options=DraftModelOptions(labels="data")), target,
                          torch.ones(128))
    other = tiny_causal_lm("llama", num_hidden_layers=2, vocab_size=96).config
    other.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"config.json: the draft model's vocab_size 96 != the target's 128"):
        build_draft_model(DraftConfig(head="draft_model", config=str(tmp_path / "config.json"),
                                      options=DraftModelOptions(init="fresh")), target, torch.ones(128))


def test_selective_filter_keeps_the_largest_gaps(target):
    head, reference = draft_for(target, seed=0), draft_for(target, seed=5)
    f = batch(target, B=3, T=21)
    states = lambda m: torch.cat([m.states(m.model, f)[:, 1:], m.states(m.model, f)[:, :1] * 0], 1)  # noqa: E731
    project = lambda m: (lambda z: F.linear(z, m.model.lm_head.weight))  # noqa: E731
    with torch.no_grad():
        mask = keep_learnable(f, states(head), project(head), states(reference), project(reference), head.teacher,
                              "kl", 0.4, chunk_tokens=5)
        trained = f.loss_mask[:, 2:].bool()
        b, t = trained.nonzero(as_tuple=True)
        gap = (token_divergences(project(head), states(head)[b, t], head.teacher, f.last_hidden_state[b, t + 1], "kl", 7)
               - token_divergences(project(reference), states(reference)[b, t], head.teacher,
                                   f.last_hidden_state[b, t + 1], "kl", 7))
    kept = mask[b, t + 2].bool()
    assert int(kept.sum()) == math.ceil(0.4 * len(gap))
    assert gap[kept].min() >= gap[~kept].max()  # the kept tokens are the largest gaps
    untouched = torch.ones_like(mask, dtype=torch.bool)
    untouched[b, t + 2] = False
    assert torch.equal(mask[untouched], f.loss_mask[untouched])  # nothing else changes
    logp = F.log_softmax(target.logits(f.last_hidden_state[b, t + 1]).float(), -1)
    logq = F.log_softmax(head.model(f.input_ids).logits[b, t + 1].float(), -1)
    torch.testing.assert_close(token_divergences(project(head), states(head)[b, t], head.teacher,
                                                 f.last_hidden_state[b, t + 1], "kl", 4),
                               divergence_rows("kl", logp, logq), atol=1e-5, rtol=1e-5)


def test_a_filtered_training_step_trains_only_the_kept_tokens(target, tmp_path):
    reference = draft_for(target, seed=5)
    export_head(reference, tmp_path / "ref", "draft_model", None)
    head = build_draft_model(DraftConfig(head="draft_model", options=DraftModelOptions(
        filter_reference=str(tmp_path / "ref"), filter_keep=0.25)), target, torch.ones(128))
    f = batch(target, B=3, T=21)
    _, filtered = head.train().loss(f)
    _, everything = head.eval().loss(f)  # evaluation measures every trained token
    assert filtered["valid_tokens"] < everything["valid_tokens"]
    assert filtered["sum/valid_0"] == math.ceil(0.25 * everything["sum/valid_0"])
    assert not any(n.startswith("_reference") for n in head.state_dict())  # the reference is never saved


def test_trains_through_the_shared_trainer_and_exports_a_plain_causal_lm(tmp_path):
    overrides = make_setup(tmp_path, head="draft_model") + [
        "--draft.num_layers=2", "--draft.init=fresh", "--draft.labels=data", "--train.max_steps=8", "--train.lr=1e-2"]
    trainer = build_trainer(load_config(None, overrides))
    final = trainer.train()
    assert {"acc_0", "sim_accept_len"} <= set(final)
    losses = train_losses(tmp_path / "run" / "metrics.jsonl")
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5
    out = tmp_path / "run" / "final"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 2
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    plain = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)  # what a server loads: nothing of ours
    trained = trainer.backend.module.model
    ids = torch.randint(3, 100, (1, 11))
    torch.testing.assert_close(plain(ids).logits, trained(ids).logits.to(torch.bfloat16).float(), atol=0.1, rtol=0.05)
    what, problems, _ = check_head(out, tmp_path / "target")
    assert what == "draft_model (hf layout)" and problems == []


def test_check_head_names_another_vocab(target, target_dir, tmp_path):
    head = draft_for(target)
    export_head(head, tmp_path / "out", "draft_model", fingerprint(target_dir))
    other = tmp_path / "other"
    tiny_causal_lm("llama", num_hidden_layers=2, vocab_size=96).save_pretrained(other)
    _, problems, _ = check_head(tmp_path / "out", other, allow_other_target=True)
    assert any(p.key == "vocab_size" and "vocab_size 128 != the target's 96" in p.message for p in problems)


@pytest.mark.parametrize("k", [1, 3])
def test_the_exported_draft_model_decodes_greedy_exact(target, target_dir, tmp_path, k):
    head = draft_for(target)
    export_head(head, tmp_path / "out", "draft_model", fingerprint(target_dir))
    loaded = DraftModel.load(tmp_path / "out", target)
    runner = TargetRunner(target, 96)
    prompt = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(3))
    want = greedy_generate(runner, prompt, 24, set()).tokens
    runner.reset()
    out = speculative_generate(runner, DistilledDrafter(loaded, 96), prompt, 24, set(), k=k)
    assert out.tokens == want
    assert sum(out.proposed) > 0 and out.target_forwards <= 24
