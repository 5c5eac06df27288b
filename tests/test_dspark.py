"""DSpark (heads/dspark): DFlash's block with slot i predicting the token after it, a Markov bias from each draft's
previous token and a confidence head -- training and decoding computing the same drafts, DeepSpec's loss recomputed
term by term, the confidence stop, and DeepSpec's layout written, read back and refused by name. (Greedy-exactness in
every declared shape, export round trips and the chi-square test run over the catalog: tests/test_catalog.py.)"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from tiny_models import randomize, tiny_causal_lm

from headstart.decode.generate import greedy_generate, speculative_generate
from headstart.decode.target_runner import TargetRunner
from headstart.heads.dspark.config import DSparkOptions
from headstart.heads.dspark.drafter import DSparkDrafter
from headstart.heads.dspark.module import DSparkDraft, build_dspark
from headstart.models.head import DraftConfig, Features, loss_denominator
from headstart.models.target import Target


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return Target(tiny_causal_lm("llama", num_hidden_layers=8))


def random_dspark(target, seed: int = 0, **options) -> DSparkDraft:
    options = {"block_size": 4, "num_layers": 2, "mask_token_id": 9, "markov_rank": 8, **options}
    head = build_dspark(DraftConfig(head="dspark", options=DSparkOptions(**options)), target)
    randomize(head, seed)
    with torch.no_grad():  # a Markov bias large enough to change drafts (randomize keeps weights small)
        head.markov_head.markov_w2.weight.mul_(40.0)
    return head


def features(target: Target, T: int = 20, seed: int = 6):
    ids = torch.randint(3, 128, (1, T), generator=torch.Generator().manual_seed(seed))
    out = target(ids)
    return ids, Features(input_ids=ids, loss_mask=torch.ones_like(ids), aux_hidden_states=out.aux_hidden_states,
                         last_hidden_state=out.last_hidden_state)


def test_the_drafter_block_is_the_training_block_and_slot_i_predicts_the_token_after_it(target):
    """At anchor a (context < a committed, bonus = token a) the drafter's B slot states are training's B drafts, and with
    the data's tokens as previous tokens its Markov-corrected logits are training's: slot 0 drafts token a+1."""
    head = random_dspark(target, anchors=100).eval()
    ids, f = features(target)
    torch.manual_seed(0)
    blocks = head.block_drafts(f)
    assert blocks.drafts.shape[2] == 4 == head.drafts_per_block  # B drafts from a block of B
    runner_out = target(ids)
    for n in (0, 5, 11):
        a = int(blocks.anchors[0, n])
        drafter = DSparkDrafter(head, 64)
        drafter._commit(runner_out.aux_hidden_states[:, :a])
        drafter.bonus = int(ids[0, a])
        h, _ = drafter._slots()
        torch.testing.assert_close(h, head.norm(blocks.drafts[0, n]), rtol=1e-4, atol=1e-5)
        prev = ids[0, a : a + 4]  # teacher forced: token a for slot 0, a+j for slot j
        want = head.slot_logits(head.norm(blocks.drafts[0, n]), head.code(prev))
        got = head.slot_logits(h, head.code(prev))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # and the greedy chain biases each slot by the draft before it, not by the data
        chain = drafter.propose(4)
        prev, manual = torch.tensor([int(ids[0, a])]), []
        for j in range(4):
            manual.append(int(head.slot_logits(h[j : j + 1], head.code(prev)).argmax()))
            prev = torch.tensor([manual[-1]])
        assert chain.tolist() == manual
        unbiased = head.lm_head(h).argmax(-1).tolist()
    assert manual != unbiased  # the bias changed some draft (else this test would not see the Markov head at all)


def test_the_loss_is_deepspecs_ce_l1_and_confidence_bce_term_by_term(target):
    """0.1 CE(data) + 0.9 sum|p - q| + 1.0 BCE(sigmoid c, 1 - TV), each weighted exp(-(j-1)/gamma), only along a block's
    contiguous trained prefix, summed over loss_denominator tokens: recomputed block by block."""
    head = random_dspark(target, anchors=5, decay_gamma=2.0)
    ids, f = features(target, T=12)  # short: some blocks run past the end (their later drafts untrained)
    mask = torch.ones_like(ids)
    mask[0, 7] = 0  # an untrained token inside: a block's drafts after it do not count, even where trained again
    f = Features(input_ids=ids, loss_mask=mask, aux_hidden_states=f.aux_hidden_states,
                 last_hidden_state=f.last_hidden_state)
    torch.manual_seed(1)
    loss, metrics = head.loss(f)
    torch.manual_seed(1)
    blocks = head.block_drafts(f)
    want, T = 0.0, 12
    with torch.no_grad():
        for n in range(blocks.anchors.shape[1]):
            a = int(blocks.anchors[0, n])
            for j in range(1, 5):
                if a + j >= T or not mask[0, a + j]:
                    break  # the prefix ends at the first untrained token
                h = head.norm(blocks.drafts[0, n, j - 1])[None]
                code = head.code(ids[0, a + j - 1 : a + j])
                logq = torch.log_softmax(head.slot_logits(h, code), -1)
                p = torch.softmax(head.lm_head(f.last_hidden_state[0, a + j - 1][None]).float(), -1)
                l1 = (p - logq.exp()).abs().sum()
                ce = -logq[0, ids[0, a + j]]
                bce = F.binary_cross_entropy_with_logits(head.confidence(h, code), (1 - l1 / 2).clamp(0, 1)[None])
                want += math.exp(-(j - 1) / 2.0) * float(0.1 * ce + 0.9 * l1 + bce)
    assert loss.item() == pytest.approx(want / float(loss_denominator(f)), rel=1e-4)
    assert 0 <= metrics["confidence_abs_error"] <= 1
    cut = [int(a) for a in blocks.anchors[0] if int(a) < 7 < int(a) + 4 and int(a) + 4 < T]
    assert cut, blocks.anchors  # some block has trained tokens after the untrained one: the rule above is exercised
    loss.backward()
    for name in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight", "fc.weight"):
        assert dict(head.named_parameters())[name].grad.abs().sum() > 0, name


def test_the_confidence_head_cuts_the_block_where_predicted_survival_falls_and_output_stays_greedy(target):
    head = random_dspark(target).eval()
    with torch.no_grad():  # confidences sigmoid(c) of about 0.73 each: survival .73, .53, .39, .29
        head.confidence_head.proj.weight.zero_()
        head.confidence_head.proj.bias.fill_(1.0)
    runner = TargetRunner(target, max_len=96, with_aux=True)
    prompt = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(2))
    plain = greedy_generate(runner, prompt, 24, set())
    for threshold, length in ((0.0, 4), (0.6, 2), (0.45, 3), (0.99, 1)):
        drafter = DSparkDrafter(head, 96)
        drafter.confidence_threshold = threshold
        got = speculative_generate(runner, drafter, prompt, 24, set(), k=4)
        assert got.tokens == plain.tokens, threshold
        # every round drafts that many but the last four, which the remaining length cuts
        assert set(got.proposed[:-4]) == {length} and len(got.proposed) > 8, (threshold, got.proposed)


def test_deepspecs_layout_is_written_and_refused_by_name(target, tmp_path):
    head = random_dspark(target)
    head.save_pretrained(tmp_path, dtype=torch.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DSparkDraftModel"] and config["model_type"] == "qwen3"
    for key, value in (("markov_rank", 8), ("markov_head_type", "vanilla"), ("enable_confidence_head", True),
                       ("confidence_head_with_markov", True), ("mask_token_id", 9), ("block_size", 4)):
        assert config[key] == value and config["dflash_config"][key] == value, key
    assert config["target_layer_ids"] == config["dflash_config"]["target_layer_ids"]
    from safetensors.torch import load_file
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert tensors["markov_head.markov_w1.weight"].shape == (128, 8) == tensors["markov_head.markov_w2.weight"].shape
    assert tensors["confidence_head.proj.weight"].shape == (1, 32 + 8) and tensors["confidence_head.proj.bias"].shape == (1,)
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in tensors)
    back = DSparkDraft.load(tmp_path, target)
    torch.testing.assert_close(back.markov_head.markov_w2.weight, head.markov_head.markov_w2.weight)

    for change, message in ((lambda c: c.update(markov_head_type="rnn") or c["dflash_config"].update(markov_head_type="rnn"),
                             r"markov_head_type 'rnn': headstart implements \['vanilla', 'gated'\]"),
                            (lambda c: [d.pop("enable_confidence_head") for d in (c, c["dflash_config"])],
                             r"a DSpark config needs \['enable_confidence_head'\]"),
                            (lambda c: c.update(architectures=["DFlashDraftModel"]), "not a DSpark config")):
        bad = json.loads(json.dumps(config))
        change(bad)
        (tmp_path / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            DSparkDraft.load(tmp_path, target)
    with pytest.raises(ValueError, match="draft.loss='rkl': a DSpark head trains its own terms"):
        build_dspark(DraftConfig(head="dspark", loss="rkl", options=DSparkOptions(mask_token_id=9)), target)
    with pytest.raises(ValueError, match=r"confidence_head_with_markov needs a Markov head"):
        build_dspark(DraftConfig(head="dspark", options=DSparkOptions(mask_token_id=9, markov_rank=0)), target)


def test_a_gated_markov_head_trains_and_round_trips(target, tmp_path):
    head = random_dspark(target, markov_head_type="gated")
    _, f = features(target)
    loss, _ = head.loss(f)
    loss.backward()
    assert head.markov_head.gate_proj.weight.grad.abs().sum() > 0
    head.save_pretrained(tmp_path, dtype=torch.float32)
    back = DSparkDraft.load(tmp_path, target)
    torch.testing.assert_close(back.markov_head.gate_proj.weight, head.markov_head.gate_proj.weight)
