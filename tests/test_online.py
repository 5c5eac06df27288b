"""Online speculative decoding (trainer/online.py): a head learning from what it serves stays exactly the target's
decoding, records exactly the states a training forward would compute, and learns the traffic it serves; the CLI
refuses what cannot learn by name."""

from __future__ import annotations

import datasets
import pytest
import torch
from test_sampling_loop import chi2_vs, exact_joint, sample_pairs, world  # noqa: F401 (world: the 8-token target)
from tiny_models import tiny_causal_lm

from headstart.decode.clock import RoundClock
from headstart.decode.generate import plain_generate, speculative_generate
from headstart.decode.target_runner import TargetRunner
from headstart.decode.tree import DynamicTree
from headstart.heads.registry import HEADS, build_head, drafter_for
from headstart.models.head import DraftConfig
from headstart.models.target import Target, TargetOutput
from headstart.scripts import benchmark
from headstart.scripts.online_args import online_learner
from headstart.trainer.config import TrainConfig
from headstart.trainer.online import OnlineLearner, OnlineSchedule, Replay, ReplayBuffer, Served

PROMPT = torch.tensor([[1, 5, 9, 14, 3, 7]])
FAST = TrainConfig(lr=1e-2, batch_size=2, mixed_precision="fp32")


@pytest.fixture(scope="module")
def target() -> Target:
    """A tiny target with peaky next-token distributions (a random init's are near uniform: nothing to learn)."""
    model = tiny_causal_lm("llama", num_hidden_layers=8, head_dim=8)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    return Target(model)


def eagle3(target: Target, dtype=torch.float32):
    spec = HEADS["eagle3"]
    torch.manual_seed(0)
    options = spec.options(**{**spec.tiny, "draft_vocab_size": target.vocab_size})  # every token draftable
    head = build_head(DraftConfig(head="eagle3", options=options), target,
                      torch.arange(target.vocab_size, dtype=torch.float32))
    return head.to(dtype).eval()


def serve(runner, learner: OnlineLearner | None, head, n: int, prompt=PROMPT, clock=None):
    make = (lambda: learner.drafter(drafter_for(head, 64))) if learner else (lambda: drafter_for(head, 64))
    return speculative_generate(runner, make(), prompt, n, set(), k=3, clock=clock)


def test_online_decoding_stays_greedy_exact_and_learns_the_traffic_it_serves(target):
    """A random head served one prompt over and over: frozen it accepts almost nothing; updated after every request
    it learns the reply, while every output stays the target's greedy decoding."""
    runner = TargetRunner(target, max_len=64, with_aux=True)
    want = plain_generate(runner, PROMPT, 24, set()).tokens
    frozen = serve(runner, None, eagle3(target), 24)
    head = eagle3(target)
    learner = OnlineLearner(head, target, OnlineSchedule(every=1, steps=8), FAST)
    before = {n: p.detach().clone() for n, p in head.named_parameters()}
    taus = []
    for _ in range(6):
        out = serve(runner, learner, head, 24)
        assert out.tokens == want
        taus.append(out.tau)
    assert learner.updates == 6 and learner.served == 6
    changed = [n for n, p in head.named_parameters() if not torch.equal(p, before[n])]
    assert changed and "embed_tokens.weight" not in changed  # the frozen embeddings stay the target's
    assert frozen.tau < 1.5 and taus[-1] > frozen.tau + 1.0, (frozen.tau, taus)


def test_replayed_conversations_are_trained_on_with_the_served_ones(target):
    """With ``Replay`` each step also trains on the original data: a head served prompt A alone, replaying the
    target's reply to prompt B, drafts B's reply too; without replay it does not."""
    runner = TargetRunner(target, max_len=64, with_aux=True)
    other = torch.tensor([[2, 8, 4, 11]])
    reply = plain_generate(runner, other, 24, set()).tokens
    ids = other[0].tolist() + reply
    dataset = datasets.Dataset.from_dict({"input_ids": [ids], "loss_mask": [[0] * other.shape[1] + [1] * len(reply)]})
    taus = {}
    for replay in (None, Replay(dataset)):
        head = eagle3(target)
        learner = OnlineLearner(head, target, OnlineSchedule(every=1, steps=8), FAST, replay)
        assert learner.train_config.grad_accum == (2 if replay else 1)
        for _ in range(6):
            assert serve(runner, learner, head, 24).tokens == plain_generate(runner, PROMPT, 24, set()).tokens
        taus[replay is not None] = serve(runner, None, head, 24, other).tau
    assert taus[True] > taus[False] + 0.5, taus


def test_served_states_are_the_training_forward_s(target):
    """What the drafter records from the verify passes equals the target's own forward over the finished sequence
    (aux and final states at every position but the last): the head trains on what a training run computes."""
    runner = TargetRunner(target, max_len=64, with_aux=True)
    head = eagle3(target)
    learner = OnlineLearner(head, target, OnlineSchedule(every=100, steps=1), FAST)
    out = serve(runner, learner, head, 20)
    (served,) = learner.buffer.requests
    assert served.input_ids.tolist() == PROMPT[0].tolist() + out.tokens and served.prompt_length == PROMPT.shape[1]
    whole = target(served.input_ids.unsqueeze(0), with_aux=True)
    T = served.tokens
    assert served.states.last_hidden_state.shape[1] == T - 1
    torch.testing.assert_close(served.states.last_hidden_state, whole.last_hidden_state[:, : T - 1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(served.states.aux_hidden_states, whole.aux_hidden_states[:, : T - 1], atol=1e-4, rtol=1e-4)


def test_a_tree_round_and_an_eos_cut_record_the_kept_positions_only(target):
    runner = TargetRunner(target, max_len=64, with_aux=True)
    head = eagle3(target)
    learner = OnlineLearner(head, target, OnlineSchedule(every=100, steps=1), FAST)
    plain = plain_generate(runner, PROMPT, 12, set()).tokens
    eos = {plain[7]}  # cut at its first occurrence, mid-round
    out = speculative_generate(runner, learner.drafter(drafter_for(head, 64)), PROMPT, 12, eos, k=3,
                               tree=DynamicTree(3, 2, 6))
    (served,) = learner.buffer.requests
    assert served.tokens == PROMPT.shape[1] + len(out.tokens) and served.states.last_hidden_state.shape[1] == served.tokens - 1
    whole = target(served.input_ids.unsqueeze(0), with_aux=True)
    torch.testing.assert_close(served.states.aux_hidden_states, whole.aux_hidden_states[:, :-1], atol=1e-4, rtol=1e-4)


def test_the_update_is_timed_as_learn_and_a_bf16_head_learns_through_a_float32_copy(target):
    runner = TargetRunner(target, max_len=64, with_aux=True)
    head = eagle3(target, torch.bfloat16)
    learner = OnlineLearner(head, target, OnlineSchedule(every=1, steps=2), FAST)
    assert not learner.in_place and learner.head is not head and next(learner.head.parameters()).dtype == torch.float32
    before = head.fc.weight.detach().clone()
    clock = RoundClock("cpu")
    serve(runner, learner, head, 16, clock=clock)
    assert clock.seconds["learn"] > 0 and learner.updates == 1
    assert not torch.equal(head.fc.weight, before) and head.fc.weight.dtype == torch.bfloat16
    torch.testing.assert_close(head.fc.weight, learner.head.fc.weight.to(torch.bfloat16))
    learner.forget()  # back to the start: weights, optimizer, buffer
    assert torch.equal(head.fc.weight, before) and len(learner.buffer) == 0 and learner.served == 0


def test_the_replay_buffer_keeps_the_latest_requests_within_its_tokens():
    def request(n: int) -> Served:
        return Served(torch.arange(n), 1, TargetOutput(aux_hidden_states=None, last_hidden_state=torch.zeros(1, n - 1, 2)))

    buffer = ReplayBuffer(25)
    for n in (10, 11, 12):
        buffer.add(request(n))
    assert [r.tokens for r in buffer.requests] == [11, 12] and buffer.tokens == 23
    buffer.add(request(40))  # alone over the budget: kept, the others leave
    assert [r.tokens for r in buffer.requests] == [40]
    with pytest.raises(ValueError, match="--online-every"):
        OnlineSchedule(every=0)


@pytest.mark.parametrize("name", sorted(HEADS))
def test_every_head_that_declares_it_learns_online_and_the_others_are_refused_by_name(name, target):
    """The conformance suite's online row: a head declaring ``learns_online`` takes an update from two served requests
    (its own loss on the recorded states) and still decodes greedy-exact; ``--online`` refuses every other by name."""
    spec = HEADS[name]
    p = benchmark.build_parser()
    method = spec.decoded_by or name  # a distilled draft model decodes as --method draft-model
    args = p.parse_args(["--target", "t", "--questions", "q", "--out", "o", "--method", method, "--draft", "d", "--online"])
    refusal = benchmark.online_refusal(p, args, benchmark.drafting_methods()[method])
    if not spec.learns_online:
        assert refusal and f"--method {method}" in refusal and "eagle3" in refusal
        return
    assert refusal is None
    torch.manual_seed(0)
    head = build_head(DraftConfig(head=name, options=spec.options(**spec.tiny)), target,
                      torch.arange(target.vocab_size, dtype=torch.float32)).eval()
    runner = TargetRunner(target, max_len=64, with_aux=spec.capabilities.reads_aux or spec.cls.needs.aux_hidden_states)
    learner = OnlineLearner(head, target, OnlineSchedule(every=2, steps=1), FAST)
    before = {n: p.detach().clone() for n, p in head.named_parameters() if p.requires_grad}
    for prompt in (PROMPT, torch.tensor([[2, 8, 4]])):
        want = plain_generate(runner, prompt, 10, set()).tokens
        assert serve(runner, learner, head, 10, prompt).tokens == want, name
    assert learner.updates == 1 and learner.last_loss is not None and learner.last_loss == learner.last_loss  # not NaN
    assert any(not torch.equal(p, before[n]) for n, p in head.named_parameters() if n in before), name
    assert serve(runner, learner, head, 10).tokens == plain_generate(runner, PROMPT, 10, set()).tokens, name


@pytest.mark.parametrize("flags, refused", [
    (["--online-every", "2"], "add --online"),
    (["--online", "--batch-size", "2"], "--batch-size 1"),
    (["--online", "--online-steps", "0"], "--online-steps must be >= 1"),
    (["--online", "--online-lr", "0"], "--online-lr must be > 0"),
])
def test_online_flags_are_refused_by_name(flags, refused, capsys):
    with pytest.raises(SystemExit):
        benchmark.main(["--target", "t", "--questions", "q", "--out", "o", "--method", "eagle3", "--draft", "d", *flags])
    assert refused in capsys.readouterr().err


def test_online_lr_overrides_the_recipe_s_rate(target, tmp_path):
    """--online-lr is the rate the optimizer steps at; without it, --online-recipe's train.lr."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("train:\n  lr: 0.003\n  optimizer: adamw\n")
    args = lambda *more: benchmark.build_parser().parse_args(  # noqa: E731
        ["--target", "t", "--questions", "q", "--out", "o", "--method", "eagle3", "--online", "--online-recipe",
         str(recipe), *more])
    rates = []
    for flags in ([], ["--online-lr", "4e-4"]):
        learner = online_learner(args(*flags), eagle3(target), target)
        rates.append({group["lr"] for opt in learner.backend.optimizers for group in opt.param_groups})
    assert rates == [{0.003}, {4e-4}]


@pytest.mark.slow  # 2,500 sampled requests, an optimizer step after every 10th: ~40 s
def test_sampling_stays_the_target_s_with_updates_between_requests(world):  # noqa: F811
    """Lossless under sampling while the head changes between requests: the chi-square test of the sampling loop."""
    model, runner, head = world
    learner = OnlineLearner(head, runner.target, OnlineSchedule(every=10, steps=1), FAST)
    try:
        pairs = sample_pairs(runner, lambda: learner.drafter(drafter_for(head.eval(), 32)), 2500, seed=0)
        assert learner.updates == 250
        stat, critical = chi2_vs(pairs, exact_joint(model))
        assert stat < critical
    finally:
        learner.forget()  # the module's head is shared with the other tests
