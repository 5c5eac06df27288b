"""The decoder's target runner: static position-indexed KV cache, rollback, tree blocks."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_causal_lm

from headstart.decode.target_runner import TargetRunner
from headstart.models.target import Target

FAMILIES = ["llama", "qwen3", "mistral", "phi3", "qwen3_moe", "gemma3_text"]


def runner_for(family: str, max_len: int = 64) -> tuple[TargetRunner, torch.nn.Module]:
    overrides = {"sliding_window": 512} if family == "gemma3_text" else {}
    model = tiny_causal_lm(family, num_hidden_layers=8, **overrides)
    return TargetRunner(Target(model), max_len=max_len), model


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decoding_through_the_cache_equals_hf_generate(family):
    runner, model = runner_for(family)
    prompt = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(0))
    logits, _ = runner.forward(prompt)
    runner.commit(prompt.shape[1])
    tokens = []
    for _ in range(20):
        token = logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
        tokens.append(token.item())
        logits, _ = runner.forward(token)
        runner.commit(1)
    with torch.no_grad():
        reference = model.generate(prompt, max_new_tokens=20, do_sample=False, min_new_tokens=20,
                                   eos_token_id=None, pad_token_id=0)[0, 7:].tolist()
    assert tokens == reference


def test_rollback_leaves_no_trace_and_aux_states_match_a_fresh_forward():
    runner, model = runner_for("llama")
    target = runner.target
    seq = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    runner.forward(seq[:, :8])
    runner.commit(8)
    runner.forward(torch.randint(3, 128, (1, 4)))  # a rejected speculative block: written, never committed
    logits, states = runner.forward(seq[:, 8:])  # overwrites the stale slots
    aux = states.aux_hidden_states
    fresh = target(seq)
    torch.testing.assert_close(aux, fresh.aux_hidden_states[:, 8:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, target.logits(fresh.last_hidden_state)[:, 8:], rtol=1e-5, atol=1e-5)


def test_tree_block_scores_each_branch_as_its_own_sequence_and_keep_compacts_the_path():
    runner, _ = runner_for("qwen3")
    target = runner.target
    prefix = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(2))
    runner.forward(prefix)
    runner.commit(6)
    # Tree: root a; children b, c of a; d child of c.   order [a, b, c, d], depths [0, 1, 1, 2]
    a, b, c, d = 11, 22, 33, 44
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    logits, states = runner.forward(torch.tensor([[a, b, c, d]]), tree_mask=tree, depths=torch.tensor([0, 1, 1, 2]))
    aux = states.aux_hidden_states
    for node, path in {1: [a, b], 3: [a, c, d]}.items():
        fresh = target(torch.cat([prefix, torch.tensor([path])], dim=1))
        torch.testing.assert_close(logits[:, node], target.logits(fresh.last_hidden_state)[:, -1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(aux[:, node], fresh.aux_hidden_states[:, -1], rtol=1e-5, atol=1e-5)
    # Accept the path a -> c -> d: its K/V move to contiguous slots 6, 7, 8, and decoding continues exactly.
    runner.cache.keep(torch.tensor([6, 8, 9]))
    assert runner.length == 9
    logits, _ = runner.forward(torch.tensor([[55]]))
    fresh = target(torch.cat([prefix, torch.tensor([[a, c, d, 55]])], dim=1))
    torch.testing.assert_close(logits[:, -1], target.logits(fresh.last_hidden_state)[:, -1], rtol=1e-5, atol=1e-5)


def test_limits_are_clear_errors():
    runner, _ = runner_for("llama", max_len=8)
    with pytest.raises(ValueError, match="KV cache overflow: 9 tokens > max_len 8"):
        runner.forward(torch.randint(3, 128, (1, 9)))


# Sliding-window targets decoded past their window: Mistral (every layer slides), Gemma 2 / 3 (sliding and
# full layers mixed: the runner passes a mask per layer type). The reference is HF's own generate.
WINDOWED = [("mistral", {"sliding_window": 8}), ("gemma2", {"sliding_window": 8}), ("gemma3_text", {"sliding_window": 8}),
            ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 4})]


@pytest.mark.parametrize("family, overrides", WINDOWED, ids=[f for f, _ in WINDOWED])
def test_decoding_past_the_sliding_window_equals_hf_generate(family, overrides):
    model = tiny_causal_lm(family, num_hidden_layers=8, **overrides)
    types = set(getattr(model.config, "layer_types", None) or ["sliding_attention"])
    assert "sliding_attention" in types  # the case under test: some layers slide
    runner = TargetRunner(Target(model), max_len=64)
    prompt = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(0))
    logits, _ = runner.forward(prompt)
    runner.commit(prompt.shape[1])
    tokens = []
    for _ in range(30):  # 35 positions: four windows
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token.item())
        logits, _ = runner.forward(token)
        runner.commit(1)
    with torch.no_grad():
        reference = model.generate(prompt, max_new_tokens=30, do_sample=False, min_new_tokens=30,
                                   eos_token_id=None, pad_token_id=0)[0, 5:].tolist()
    assert tokens == reference


def test_a_tree_block_past_the_window_scores_each_branch_as_its_own_sequence():
    model = tiny_causal_lm("gemma3_text", num_hidden_layers=8, sliding_window=8)
    runner = TargetRunner(Target(model), max_len=64)
    target = runner.target
    prefix = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(2))
    runner.forward(prefix)
    runner.commit(20)
    a, b, c, d = 11, 22, 33, 44
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    logits, _ = runner.forward(torch.tensor([[a, b, c, d]]), tree_mask=tree, depths=torch.tensor([0, 1, 1, 2]))
    for node, path in {1: [a, b], 3: [a, c, d]}.items():
        fresh = target(torch.cat([prefix, torch.tensor([path])], dim=1))
        torch.testing.assert_close(logits[:, node], target.logits(fresh.last_hidden_state)[:, -1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("path", [[0, 2, 3], [0, 2], [0, 1], [0]])
def test_keeping_a_tree_path_moves_what_a_compiled_runner_moves_in_one_call(path):
    """``TargetRunner.keep``: the leading run already in place is committed as it is, the rest moved -- on the compiled
    runner in one call for every layer -- and both runners then decode on as the target does after the prefix and
    the path's tokens."""
    from headstart.benchmarks.drafter_launches import eager_ops

    target = Target(tiny_causal_lm("llama", num_hidden_layers=8))
    runners = [TargetRunner(target, 32), TargetRunner(target, 32, compile=True, backend="eager")]
    prefix = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(2))
    # Root a; children b, c of a; d child of c: order [a, b, c, d], depths [0, 1, 1, 2].
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    block = torch.tensor([[11, 22, 33, 44]])
    fresh = target(torch.cat([prefix, block[:, path], torch.tensor([[55]])], dim=1))
    want = target.logits(fresh.last_hidden_state)[:, -1]
    counts = []
    for runner in runners:
        runner.forward(prefix)
        runner.commit(6)
        for counted in (False, True):  # the first keep compiles the move
            runner.cache.rollback(6)
            runner.forward(block, tree_mask=tree, depths=torch.tensor([0, 1, 1, 2]))
            ops = eager_ops(lambda runner=runner: runner.keep(path)) if counted else runner.keep(path)
        assert runner.length == 6 + len(path)
        counts.append(ops)
        torch.testing.assert_close(runner.forward(torch.tensor([[55]]))[0][:, -1], want, rtol=1e-5, atol=1e-5)
    in_place = next((i for i, index in enumerate(path) if index != i), len(path))
    if in_place == len(path):
        assert counts == [0, 0]  # nothing to move
    else:
        assert counts[0] >= 4 * 8 and counts[1] <= 4  # 4 ops a layer eagerly; one call compiled


def test_tuned_blocks_run_padded_to_the_cheapest_size_and_score_the_same(monkeypatch):
    """tune_blocks times blocks of 1..5 tokens (here: costs handed in, in that order) and pads each block to the
    cheapest size that holds it; a padded block's logits and states equal the unpadded ones, and decoding through
    the padded runner is still the target's greedy decoding."""
    from headstart.decode import target_runner
    from headstart.decode.generate import greedy_generate, speculative_generate
    from headstart.decode.ngram import NgramDrafter

    costs = iter([1.0, 5.0, 4.0, 2.0, 3.0])  # blocks of 2 and 3 cost more than 4: run them as 4
    monkeypatch.setattr(target_runner, "median_seconds", lambda fn, repeats, device: (fn(), next(costs))[1])
    runner, model = runner_for("llama", max_len=96)
    plain = TargetRunner(runner.target, max_len=96)
    assert runner.tune_blocks(5, context=32) == {1: 1, 2: 4, 3: 4, 4: 4, 5: 5}
    assert runner.length == 0  # tuning leaves the cache empty
    assert target_runner.pad_sizes({1: 1.0, 2: 1.0, 3: 0.97}) == {1: 1, 2: 2, 3: 3}  # within the noise margin: unpadded
    assert target_runner.pad_sizes({1: 0.5, 2: 1.0, 3: 0.9}) == {1: 1, 2: 3, 3: 3}

    run_sizes = []
    real_run = runner._run
    monkeypatch.setattr(runner, "_run", lambda ids, *a: (run_sizes.append(ids.shape[1]), real_run(ids, *a))[1])
    prompt = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    for r in (runner, plain):
        r.forward(prompt)
        r.commit(9)
    block = torch.randint(3, 128, (1, 2), generator=torch.Generator().manual_seed(2))
    logits, states = runner.forward(block)
    want_logits, want_states = plain.forward(block)
    assert run_sizes[-1] == 4 and logits.shape[1] == 2
    last, _ = runner.forward(block, last_only=True)  # a last-only read is not padded: its one row is the real last
    assert run_sizes[-1] == 2
    torch.testing.assert_close(last, want_logits[:, -1:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states.aux_hidden_states, want_states.aux_hidden_states, rtol=1e-4, atol=1e-4)

    run_sizes.clear()
    prompt = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])  # repeats: n-gram drafts of every length
    spec = speculative_generate(runner, NgramDrafter(), prompt, 40, set(), k=4)
    assert spec.tokens == greedy_generate(plain, prompt, 40, set()).tokens
    assert {1, 2} & set(spec.proposed), spec.proposed  # verify blocks of 2-3 tokens were asked for ...
    assert not {2, 3} & set(run_sizes), run_sizes  # ... and every one ran padded to 4


def test_forward_layers_is_the_targets_first_layers_on_its_own_cache():
    E = 3
    target = Target(tiny_causal_lm("llama", num_hidden_layers=8), aux_layer_ids=(E,))
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    want = target.model(ids, output_hidden_states=True).hidden_states[E]  # after layers 0..E-1
    runner = TargetRunner(target, 32, with_aux=False)
    runner.forward(ids[:, :8])
    runner.commit(8)
    got = [runner.forward_layers(ids[:, 8 + i: 9 + i], E, 8 + i) for i in range(4)]  # one token at a time, as drafts
    torch.testing.assert_close(torch.cat(got, 1), want[:, 8:], atol=1e-5, rtol=1e-5)
    assert runner.length == 8  # nothing committed
    keys = [layer.keys[:, :, 8:12].clone() for layer in runner.cache.layers[:E]]
    logits, _ = runner.forward(ids[:, 8:])  # verification over the same slots: every layer, the drafts' K/V rewritten
    torch.testing.assert_close(logits[0], target.model(ids).logits[0, 8:], atol=1e-5, rtol=1e-5)
    for before, layer in zip(keys, runner.cache.layers[:E]):  # the same K/V the drafts wrote: nothing to keep twice
        torch.testing.assert_close(layer.keys[:, :, 8:12], before, atol=1e-5, rtol=1e-5)
    assert target.model.config.num_hidden_layers == 8 and len(target.base.layers) == 8  # the cut is undone


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_forward_from_continues_the_first_layers_to_the_targets_logits(family):
    """Self-speculation's verification: layers E.. over hidden states forward_layers left, on the K/V it wrote, give
    the full model's logits; layers 0..E-1 do not run again; the cut is undone."""
    E = 3
    target = Target(tiny_causal_lm(family, num_hidden_layers=8), aux_layer_ids=(E,))
    ids = torch.randint(3, 128, (1, 14), generator=torch.Generator().manual_seed(1))
    runner = TargetRunner(target, 32, with_aux=False)
    runner.forward(ids[:, :8])
    runner.commit(8)
    entered = [runner.forward_layers(ids[:, 8 + i: 9 + i], E, 8 + i) for i in range(5)]  # a chain's inputs, one by one
    entered.append(runner.forward_layers(ids[:, 13:14], E, 13))  # the last draft, at verification
    calls = []
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: calls.append(i))
             for i, layer in enumerate(target.base.layers)]
    logits, states = runner.forward_from(torch.cat(entered, 1), E, 8)
    for h in hooks:
        h.remove()
    assert sorted(set(calls)) == list(range(E, 8))  # only the layers after the exit
    torch.testing.assert_close(logits[0], target.model(ids).logits[0, 8:], atol=1e-5, rtol=1e-5)
    assert states.aux_hidden_states is None and states.last_hidden_state.shape == (1, 6, target.hidden_size)
    runner.commit(6)  # and decoding goes on from that cache as from a full forward
    nxt, _ = runner.forward(ids[:, :1])
    torch.testing.assert_close(nxt[0, 0], target.model(torch.cat([ids, ids[:, :1]], 1)).logits[0, -1], atol=1e-5,
                               rtol=1e-5)
    assert target.model.config.num_hidden_layers == 8 and len(target.base.layers) == 8
    with pytest.raises(ValueError, match="with_aux=False"):
        TargetRunner(target, 32, with_aux=True).forward_from(torch.cat(entered, 1), E, 0)
