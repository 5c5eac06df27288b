"""Batched decoding (decode/batch_generate.py): every sequence of a batch decodes exactly as it would alone."""

from __future__ import annotations

import pytest
import torch
from test_sampling_loop import SAMPLING, V, chi2_vs, exact_joint, medusa_heads, PROMPT
from tiny_models import random_eagle3_head, random_peagle_head, tiny_causal_lm

from headstart.decode.batch_generate import PerSequence, batch_plain_generate, batch_speculative_generate
from headstart.decode.draft_model import DraftModelDrafter
from headstart.heads.eagle3.drafter import Eagle3Drafter
from headstart.decode.generate import plain_generate, speculative_generate
from headstart.heads.medusa.drafter import MedusaDrafter
from headstart.heads.mtp.drafter import MTPDrafter
from headstart.heads.peagle.drafter import PEagleDrafter
from headstart.decode.ngram import NgramDrafter
from headstart.decode.target_runner import RaggedRunner, TargetRunner
from headstart.decode.verify import Verification
from headstart.heads.mtp.module import build_mtp
from headstart.models.target import Target

MAX_LEN = 160


def prompts(vocab: int = 128) -> list[torch.Tensor]:
    """Prompts of different lengths; repetitive, so prompt lookup and the heads get some drafts accepted."""
    g = torch.Generator().manual_seed(3)
    out = []
    for n in (5, 9, 3, 12):
        phrase = torch.randint(3, vocab, (n,), generator=g)
        out.append(torch.cat([phrase, phrase, phrase[: n // 2 + 1]]).unsqueeze(0))
    return out


@pytest.fixture(scope="module")
def world():
    # float64 (HF's eager softmax still runs in float32, so a row padded to another length differs by ~1e-7): keeps
    # near-ties rarer, where an argmax could flip between the batched and the lone forward.
    model = tiny_causal_lm("llama", num_hidden_layers=8).double()
    target = Target(model)
    return model, target, TargetRunner(target, MAX_LEN), RaggedRunner(target, MAX_LEN)


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("gemma2", {"sliding_window": 6}),
                                              ("mistral", {"sliding_window": 5})])
def test_a_ragged_forward_equals_each_row_alone(family, overrides):
    """Rows of different committed lengths and different numbers of real tokens: each row's logits at its real
    tokens equal its own forward (sliding windows included), and its padding never reaches a later forward."""
    target = Target(tiny_causal_lm(family, num_hidden_layers=8, **overrides).double())
    alone, ragged = TargetRunner(target, 64), RaggedRunner(target, 64)
    rows = prompts()[:3]
    ragged.reset(len(rows))
    first = torch.zeros(3, max(p.shape[1] for p in rows) + 2, dtype=torch.long)  # every row padded
    for b, p in enumerate(rows):
        first[b, : p.shape[1]] = p[0]
    lengths = [p.shape[1] for p in rows]
    logits, _ = ragged.forward(first, valid=lengths)
    ragged.commit(lengths)
    block = torch.tensor([[7, 8, 9], [10, 11, 12], [13, 14, 15]])
    valid = [3, 1, 2]
    block_logits, _ = ragged.forward(block, valid=valid)
    for b, p in enumerate(rows):
        alone.reset()
        expected, _ = alone.forward(p)
        torch.testing.assert_close(logits[b, : lengths[b]], expected[0], rtol=1e-5, atol=1e-6)
        alone.commit(p.shape[1])
        expected, _ = alone.forward(block[b : b + 1, : valid[b]])
        torch.testing.assert_close(block_logits[b, : valid[b]], expected[0], rtol=1e-5, atol=1e-6)


def test_plain_batch_equals_each_prompt_alone_and_drops_finished_rows(world):
    model, _, alone, ragged = world
    ps = prompts()
    reference = [plain_generate(alone, p, 24, set()).tokens for p in ps]
    eos = {reference[2][5]}  # the third sequence stops early (at its first occurrence of this token)
    expected = [plain_generate(alone, p, 24, eos).tokens for p in ps]
    outs, steps = batch_plain_generate(ragged, ps, 24, eos)
    assert [o.tokens for o in outs] == expected
    assert len(expected[2]) < 24 and steps == max(len(t) for t in expected) - 1
    assert len(ragged.cache.lengths) == 0  # every row left the batch when it finished


def drafter_makers(world):
    """method -> (one-sequence drafter maker, batch drafter maker taking the batch size)."""
    model, target, _, _ = world
    torch.manual_seed(0)
    eagle3 = random_eagle3_head(target).double()
    peagle = random_peagle_head(target, parallel_tokens=5).double()
    mtp = build_mtp(target).double()
    heads = medusa_heads(model).double()
    small = tiny_causal_lm("llama", num_hidden_layers=1).double()
    vocab = model.config.vocab_size
    single = {"eagle3": lambda: Eagle3Drafter(eagle3, MAX_LEN), "mtp": lambda: MTPDrafter(mtp, MAX_LEN),
              "medusa": lambda: MedusaDrafter(heads), "ngram": NgramDrafter,
              "draft-model": lambda: DraftModelDrafter(small, MAX_LEN, vocab), "peagle": lambda: PEagleDrafter(peagle, MAX_LEN)}
    makers = {m: (make, lambda b, make=make: PerSequence([make() for _ in range(b)])) for m, make in single.items()}
    makers["eagle3-batched"] = (single["eagle3"], lambda b: Eagle3Drafter(eagle3, MAX_LEN))
    makers["mtp-batched"] = (single["mtp"], lambda b: MTPDrafter(mtp, MAX_LEN))
    makers["peagle-batched"] = (single["peagle"], lambda b: PEagleDrafter(peagle, MAX_LEN))
    makers["medusa-batched"] = (single["medusa"], lambda b: MedusaDrafter(heads, MAX_LEN))
    makers["draft-model-batched"] = (single["draft-model"], lambda b: DraftModelDrafter(small, MAX_LEN, vocab))
    # multi-layer drafts (a cache layer each), made last so the heads above keep their weights
    eagle3_layers = random_eagle3_head(target, num_layers=2).double()
    peagle_layers = random_peagle_head(target, parallel_tokens=5, num_layers=3).double()
    makers["eagle3-2-layers-batched"] = (lambda: Eagle3Drafter(eagle3_layers, MAX_LEN),
                                         lambda b: Eagle3Drafter(eagle3_layers, MAX_LEN))
    makers["peagle-3-layers-batched"] = (lambda: PEagleDrafter(peagle_layers, MAX_LEN),
                                         lambda b: PEagleDrafter(peagle_layers, MAX_LEN))
    return makers


@pytest.mark.parametrize("method", ["eagle3", "eagle3-batched", "mtp", "mtp-batched", "medusa", "medusa-batched",
                                    "ngram", "draft-model", "draft-model-batched", "peagle", "peagle-batched",
                                    "eagle3-2-layers-batched", "peagle-3-layers-batched"])
@pytest.mark.parametrize("k,max_new", [(3, 30), (5, 7)])
def test_greedy_batch_equals_each_prompt_alone_tau_included(world, method, k, max_new):
    """Tokens, target forwards and accepted drafts of every round, per sequence, equal decoding it alone."""
    _, _, alone, ragged = world
    make, make_batch = drafter_makers(world)[method]
    ps = prompts()
    expected = [speculative_generate(alone, make(), p, max_new, set(), k) for p in ps]
    outs, rounds = batch_speculative_generate(ragged, make_batch(len(ps)), ps, max_new, set(), k)
    for got, want in zip(outs, expected):
        assert got.tokens == want.tokens
        assert (got.target_forwards, got.accepted, got.proposed) == (want.target_forwards, want.accepted, want.proposed)
        assert got.tau == want.tau
    assert rounds == max(w.target_forwards for w in expected)
    if method == "ngram":
        assert sum(sum(w.accepted) for w in expected) > 0  # the case under test: drafts were accepted somewhere


def test_greedy_batch_with_eos_stops_each_row_where_alone(world):
    _, _, alone, ragged = world
    make, make_batch = drafter_makers(world)["ngram"]
    ps = prompts()
    plain = [plain_generate(alone, p, 30, set()).tokens for p in ps]
    eos = {plain[0][4], plain[3][9]}
    expected = [speculative_generate(alone, make(), p, 30, eos, 4).tokens for p in ps]
    outs, _ = batch_speculative_generate(ragged, make_batch(len(ps)), ps, 30, eos, 4)
    assert [o.tokens for o in outs] == expected
    assert len(expected[0]) <= 5 and len(expected[3]) <= 10


@pytest.fixture(scope="module")
def small_vocab():
    model = tiny_causal_lm("llama", num_hidden_layers=8, vocab_size=V)
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)  # peaky, context-dependent distributions (as test_sampling_loop)
    return model, RaggedRunner(Target(model), 32)


@pytest.mark.parametrize(("drafter", "verification"), [
    *((d, "token") for d in ("eagle3-sampled", "eagle3-batched", "medusa", "mtp-batched", "draft-model-batched",
                             "peagle-batched")),
    ("draft-model-batched", "block"), ("medusa", "block")])
def test_batched_speculative_samples_follow_the_target(small_vocab, drafter, verification):
    """Lossless in a batch: 2,000 sequences decoded 250 at a time; the joint of the 2nd and 3rd tokens matches the
    warped target's exact joint (chi-square at p = 0.001), chains verified token by token or as a block (a drafter
    with its own q, and one with one-hot q)."""
    model, ragged = small_vocab
    target = ragged.target
    torch.manual_seed(1)
    head = random_eagle3_head(target, draft_vocab_size=V)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    heads = medusa_heads(model)
    mtp = build_mtp(target)
    for p in mtp.parameters():
        torch.nn.init.normal_(p, std=0.3)
    peagle = random_peagle_head(target, draft_vocab_size=V, parallel_tokens=3, mask_token_id=V - 1)
    small_model = tiny_causal_lm("llama", num_hidden_layers=1, vocab_size=V)
    with torch.no_grad():
        small_model.lm_head.weight.mul_(30.0)  # its own peaky q, far from the target's p
    make = {"eagle3-sampled": lambda: PerSequence([Eagle3Drafter(head, 32) for _ in range(250)]),
            "eagle3-batched": lambda: Eagle3Drafter(head, 32),
            "medusa": lambda: PerSequence([MedusaDrafter(heads) for _ in range(250)]),
            "mtp-batched": lambda: MTPDrafter(mtp, 32),
            "draft-model-batched": lambda: DraftModelDrafter(small_model, 32, V),
            "peagle-batched": lambda: PEagleDrafter(peagle, 32)}[drafter]
    g = torch.Generator().manual_seed(0)
    pairs = []
    for _ in range(8):
        outs, _ = batch_speculative_generate(ragged, make(), [PROMPT] * 250, 4, set(), 3, sampling=SAMPLING, generator=g,
                                             verification=Verification(verification))
        pairs += [(o.tokens[1], o.tokens[2]) for o in outs]
    stat, critical = chi2_vs(pairs, exact_joint(model))
    assert stat < critical


@pytest.mark.parametrize("name", ["eagle3", "mtp", "draft-model"])
def test_batched_draft_steps_compute_each_rows_logits_as_alone(world, name, monkeypatch):
    """Every draft-step distribution of the batched drafter -- after the prompt, through speculative steps, after a
    ragged commit -- equals the one-sequence drafter's for that row (a position or a cache slot off by one moves
    these even where the argmax, and so the accepted drafts, happen not to move)."""
    model, target, alone, ragged = world
    torch.manual_seed(0)
    vocab = model.config.vocab_size
    calls: list[torch.Tensor] = []
    if name == "draft-model":  # every logits row the small model produces passes through fit_vocab
        import headstart.decode.draft_model as draft_module

        small = tiny_causal_lm("llama", num_hidden_layers=2).double()
        inner = draft_module.fit_vocab
        monkeypatch.setattr(draft_module, "fit_vocab", lambda x, v: calls.append(inner(x, v)) or calls[-1])
        single_drafter = lambda: DraftModelDrafter(small, MAX_LEN, vocab)  # noqa: E731
        batch_drafter = lambda b: DraftModelDrafter(small, MAX_LEN, vocab)  # noqa: E731
    else:
        head = (random_eagle3_head(target) if name == "eagle3" else build_mtp(target)).double()
        cls = Eagle3Drafter if name == "eagle3" else MTPDrafter
        single_drafter = lambda: cls(head, MAX_LEN)  # noqa: E731
        batch_drafter = lambda b: cls(head, MAX_LEN)  # noqa: E731

    def record(drafter):  # every draft distribution the drafter computes, in order
        if name == "eagle3":
            inner = drafter._logits
            drafter._logits = lambda h: calls.append(inner(h)) or calls[-1]
        return drafter

    if name == "mtp":
        inner = head.logits
        head.logits = lambda h: calls.append(inner(h)) or calls[-1]
    ps = prompts()
    emitted = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14]]  # a ragged commit: rows emit different numbers of tokens
    expected = []
    for b, p in enumerate(ps):
        calls.clear()
        d = record(single_drafter())
        alone.reset()
        logits, states = alone.forward(p)
        alone.commit(p.shape[1])
        d.begin(p, states, int(logits[0, -1].argmax()))
        d.propose(4)
        _, states = alone.forward(torch.tensor([emitted[b]]))
        d.update(emitted[b], states)
        d.propose(3)
        expected.append([c.reshape(-1, c.shape[-1])[-1] for c in calls])
    calls.clear()
    d = record(batch_drafter(len(ps)))
    lengths = [p.shape[1] for p in ps]
    ids = torch.zeros(len(ps), max(lengths), dtype=torch.long)
    for b, p in enumerate(ps):
        ids[b, : lengths[b]] = p[0]
    ragged.reset(len(ps))
    logits, states = ragged.forward(ids, valid=lengths)
    ragged.commit(lengths)
    d.begin_batch(ps, states, [int(logits[b, n - 1].argmax()) for b, n in enumerate(lengths)])
    d.propose_batch([4] * len(ps))
    block = torch.tensor([e + [0] * (4 - len(e)) for e in emitted])
    _, states = ragged.forward(block, valid=[len(e) for e in emitted])
    d.update_batch(emitted, states)
    d.propose_batch([3] * len(ps))
    assert len(calls) == len(expected[0]) == 1 + 3 + 1 + 2
    for b in range(len(ps)):
        for got, want in zip(calls, expected[b]):
            torch.testing.assert_close(got.reshape(len(ps), -1, got.shape[-1])[b, -1], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["eagle3", "mtp", "medusa"])
def test_a_demo_head_batched_accepts_exactly_as_alone(name):
    """A trained head (the demo heads on the demo target, in float64) accepts drafts, so its drafter's batch proposals
    -- not just the target's tokens -- are checked against its one-sequence proposals round by round, at batch 3 and
    1, one drafter serving all three."""
    from pathlib import Path

    from headstart.heads.registry import drafter_for, load_head
    from headstart.models.target import TargetConfig, load_tokenizer

    repo = Path(__file__).resolve().parents[1]
    target = Target.from_pretrained(TargetConfig(path=str(repo / "configs/demo/target"), dtype="float32", device="cpu"))
    target.model.double()
    head = load_head(name, str(repo / f"configs/demo/{name}-head"), target).double()
    tokenizer = load_tokenizer(str(repo / "configs/demo/target"))
    texts = ["Write a haiku about the sea.", "What is 12 times 7? Explain step by step.", "Name three colours."]
    ps = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"] for t in texts]
    alone, ragged = TargetRunner(target, 256), RaggedRunner(target, 256)
    drafter = drafter_for(head, 256)  # the head's one drafter: each prompt alone, then as a batch, then a batch of 1
    expected = [speculative_generate(alone, drafter, p, 40, set(), 4) for p in ps]
    outs, _ = batch_speculative_generate(ragged, drafter, ps, 40, set(), 4)
    for got, want in zip(outs, expected):
        assert got.tokens == want.tokens and got.accepted == want.accepted and got.proposed == want.proposed
    (one,), _ = batch_speculative_generate(ragged, drafter, ps[1:2], 40, set(), 4)
    assert (one.tokens, one.accepted, one.proposed) == (expected[1].tokens, expected[1].accepted, expected[1].proposed)
    # The case under test: rounds accept drafts (EAGLE-3 accepts most, Medusa's demo heads least).
    assert sum(sum(w.accepted) for w in expected) > {"eagle3": 20, "mtp": 10, "medusa": 10}[name]


def test_the_demo_draft_model_batched_accepts_exactly_as_alone():
    """The demo draft model (2 layers, trained on the demo target's data) accepts drafts on the demo target, so its
    batched drafter's proposals are checked against the one-sequence drafter round by round."""
    from pathlib import Path

    from headstart.models.target import TargetConfig, load_causal_lm, load_tokenizer

    repo = Path(__file__).resolve().parents[1]
    config = lambda name: TargetConfig(path=str(repo / "configs/demo" / name), dtype="float32", device="cpu")  # noqa: E731
    target = Target.from_pretrained(config("target"))
    target.model.double()
    small = load_causal_lm(config("draft-model")).double()
    tokenizer = load_tokenizer(str(repo / "configs/demo/target"))
    texts = ["Write a haiku about the sea.", "What is 12 times 7? Explain step by step.", "Name three colours."]
    ps = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"] for t in texts]
    vocab = target.lm_head.weight.shape[0]
    alone, ragged = TargetRunner(target, 256), RaggedRunner(target, 256)
    expected = [speculative_generate(alone, DraftModelDrafter(small, 256, vocab), p, 40, set(), 4) for p in ps]
    outs, _ = batch_speculative_generate(ragged, DraftModelDrafter(small, 256, vocab), ps, 40, set(), 4)
    for got, want in zip(outs, expected):
        assert got.tokens == want.tokens and got.accepted == want.accepted and got.proposed == want.proposed
    assert sum(sum(w.accepted) for w in expected) > 20  # the case under test: the draft model's drafts are accepted


def test_batch_caches_grow_past_their_first_allocation(world):
    """The batch's target cache and EAGLE-3's batched draft cache start at 256 slots and grow on demand: decoding
    across that boundary equals decoding alone."""
    _, target, _, _ = world
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(3, 128, (1, n), generator=g) for n in (236, 250)]
    alone, ragged = TargetRunner(target, 400), RaggedRunner(target, 400)
    head = random_eagle3_head(target).double()
    expected = [speculative_generate(alone, Eagle3Drafter(head, 400), p, 30, set(), 3).tokens for p in ps]
    drafter = Eagle3Drafter(head, 400)
    outs, _ = batch_speculative_generate(ragged, drafter, ps, 30, set(), 3)
    assert [o.tokens for o in outs] == expected
    assert drafter.rows.cache.layers[0].keys.shape[2] > 256 and ragged.cache.layers[0].keys.shape[2] > 256  # both grew


@pytest.mark.parametrize("method,backend", [pytest.param("ngram", "eager", marks=pytest.mark.slow), ("eagle3-batched", "eager"),
                                            pytest.param("mtp-batched", "eager", marks=pytest.mark.nightly),
                                            pytest.param("eagle3-batched", "inductor", marks=pytest.mark.nightly)])
def test_a_compiled_batch_decodes_each_prompt_as_alone_and_finished_rows_recompile_nothing(world, method, backend):
    """``RaggedRunner(compile=True)``: rows that finish early stay as dead rows of the static batch, so after
    ``precompile`` (plain decoding's width 1 and the verify's k + 1, at each key window) nothing compiles
    mid-generation; every row's tokens and acceptance are those of decoding it alone, across a key window's edge."""
    model, target, alone, _ = world
    make, make_batch = drafter_makers(world)[method]
    ps = prompts()
    plain = [plain_generate(alone, p, 110, set()).tokens for p in ps]
    eos = {plain[0][4], plain[3][9]} - set(plain[1])  # two rows finish early, at different rounds; row 1 runs on
    expected = [speculative_generate(alone, make(), p, 110, eos, 3) for p in ps]
    assert len(expected[0].tokens) <= 5 and len(expected[3].tokens) <= 10  # the case under test: rows finished early
    assert ps[1].shape[1] + len(expected[1].tokens) > 128  # and a row's keys crossed the first key window
    graphs = []

    def counting(gm, example_inputs):  # a dynamo backend that counts the graphs it is given
        graphs.append(gm)
        return gm.forward if backend == "eager" else torch._inductor.compile(gm, example_inputs)

    torch._dynamo.reset()
    compiled = RaggedRunner(target, MAX_LEN, compile=True, backend=counting)
    compiled.precompile_batch(len(ps), [1, 4])
    assert len(graphs) == 4  # widths 1 and 4, key windows 128 and 160 (MAX_LEN)
    buffer = compiled.cache.layers[0].keys
    compiled.precompile_batch(3, [1, 4])  # a smaller last batch: its own buffers and graphs, the first size's kept
    assert len(graphs) == 8
    outs, _ = batch_speculative_generate(compiled, make_batch(len(ps)), ps, 110, eos, 3)
    for got, want in zip(outs, expected):
        assert (got.tokens, got.accepted, got.proposed) == (want.tokens, want.accepted, want.proposed)
    plains, _ = batch_plain_generate(compiled, ps[:3], 110, eos)
    assert [o.tokens for o in plains] == [w.tokens for w in expected[:3]]
    again, _ = batch_speculative_generate(compiled, make_batch(len(ps)), ps, 110, eos, 3)
    assert [o.tokens for o in again] == [w.tokens for w in expected]
    # nothing compiled mid-generation: shorter drafts ran padded to the verify's width, finished rows stayed as dead
    # rows, and each batch size went back to its own buffers
    assert len(graphs) == 8
    assert compiled.cache.layers[0].keys is buffer and buffer.shape[0] == 4  # its own buffers again, dead rows kept


@pytest.mark.parametrize("name,backend", [("eagle3", "eager"), pytest.param("mtp", "eager", marks=pytest.mark.slow),
                                          pytest.param("eagle3", "inductor", marks=pytest.mark.nightly),
                                          pytest.param("mtp", "inductor", marks=pytest.mark.nightly)])
def test_compiled_batch_drafters_draft_as_alone_and_compile_nothing_mid_generation(world, name, backend):
    """EAGLE-3's and MTP's batched layers compiled (``RaggedBlocks``): one drafter reused for batches of 4 and 3 rows,
    rows finishing early, a row crossing a key window -- every row decodes as alone, and after ``precompile`` (blocks
    of 1..k + 1 at each key window, per batch size) no graph compiles mid-generation."""
    _, target, alone, ragged = world
    torch.manual_seed(0)
    head = (random_eagle3_head(target) if name == "eagle3" else build_mtp(target)).double()
    cls = Eagle3Drafter if name == "eagle3" else MTPDrafter
    ps = prompts()
    plain = [plain_generate(alone, p, 110, set()).tokens for p in ps]
    eos = {plain[0][4], plain[3][9]} - set(plain[1])
    expected = [speculative_generate(alone, cls(head, MAX_LEN), p, 110, eos, 3) for p in ps]
    assert len(expected[0].tokens) <= 5 and ps[1].shape[1] + len(expected[1].tokens) > 128
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward if backend == "eager" else torch._inductor.compile(gm, example_inputs)

    torch._dynamo.reset()
    drafter = cls(head, MAX_LEN, compile=True, backend=counting)
    drafter.precompile_batch(len(ps), 4)
    drafter.precompile_batch(3, 4)
    assert len(graphs) == 16  # widths 1..4 x key windows 128 and 160 x batch sizes 4 and 3
    runner = RaggedRunner(target, MAX_LEN, compile=True, backend=counting)  # the target compiled too, as --compile runs
    runner.precompile_batch(len(ps), [1, 4])
    runner.precompile_batch(3, [1, 4])
    assert len(graphs) == 24
    outs, _ = batch_speculative_generate(runner, drafter, ps, 110, eos, 3)
    for got, want in zip(outs, expected):
        assert (got.tokens, got.accepted, got.proposed) == (want.tokens, want.accepted, want.proposed)
    outs, _ = batch_speculative_generate(ragged, drafter, ps[:3], 110, eos, 3)
    assert [(o.tokens, o.accepted) for o in outs] == [(w.tokens, w.accepted) for w in expected[:3]]
    assert len(graphs) == 24 and drafter.rows.cache.layers[0].keys.shape[0] == 3  # dead rows kept, nothing recompiled
    eager = cls(head, MAX_LEN)
    outs, _ = batch_speculative_generate(ragged, eager, ps, 110, eos, 3)
    assert [o.tokens for o in outs] == [w.tokens for w in expected]
    assert eager.rows.cache.layers[0].keys.shape[0] == 0  # eagerly, finished rows left the buffers


@pytest.mark.slow  # 26 s here: with CI's slow tests, out of the default suite's ten minutes
def test_compiled_ragged_blocks_raise_dynamos_recompile_limit_to_what_they_compile():
    """Every ``RaggedBlocks`` compiles the same ``_run``: two of them with many widths and key windows need more
    graphs than dynamo's default limit of 64 per function, past which it would quietly run the rest eagerly."""
    from headstart.decode.ragged_blocks import RaggedBlocks

    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(hidden, tokens, positions, allowed, cache):
        kv = (tokens[:, None, :, None] + positions[:, None, :, None]).float()  # [B, 1, m, 1]
        keys, _ = cache.update(kv, kv, 0)
        return kv[:, 0, :, 0] + allowed.sum(-1) + keys.sum()  # [B, m]

    torch._dynamo.reset()
    # two steps (a target's and a drafter's): blocks with the same step function would share their graphs
    blocks = [RaggedBlocks(fn, 2048, torch.device("cpu"), compile=True, backend=counting)
              for fn in (step, lambda *args: step(*args) * 2)]
    for b in blocks:
        for batch in (2, 3):
            b.precompile(batch, range(1, 8))
    assert len(graphs) == 2 * 2 * 7 * 5  # blocks x batch sizes x widths 1..7 x key windows 128 .. 2048


def test_a_compiled_batch_past_its_cache_is_refused_by_name(world):
    _, target, _, _ = world
    runner = RaggedRunner(target, 40, compile=True, backend="eager")
    with pytest.raises(ValueError, match=r"KV cache overflow: 41 tokens > max_len 40 \(raise --max-len\)"):
        batch_plain_generate(runner, prompts()[:2], 40, set())
