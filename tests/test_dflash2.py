"""DFlash2 (heads/dflash2): DFlash with dynamic causal convolutions over the block and a candidate selector -- the
identity at initialisation, training and decoding computing the same blocks (the convolutions stop at each block's
first slot), the selector's greedy walk and loss recomputed by hand, and z-lab's names written and refused by name.
(Greedy-exactness in every shape, export round trips and the chi-square test: tests/test_catalog.py; z-lab's own
classes reading the export: tests/test_zlab_reader.py.)"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tiny_models import randomize, tiny_causal_lm

from headstart.heads.dflash.config import DFlashOptions
from headstart.heads.dflash.drafter import DFlashDrafter
from headstart.heads.dflash.module import build_dflash
from headstart.heads.dflash2.config import DFlash2Options
from headstart.heads.dflash2.drafter import DFlash2Drafter
from headstart.heads.dflash2.module import DFlash2Draft, build_dflash2
from headstart.models.head import DraftConfig, Features, loss_denominator
from headstart.models.target import Target


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return Target(tiny_causal_lm("llama", num_hidden_layers=8))


def dflash2(target, **options) -> DFlash2Draft:
    options = {"block_size": 4, "num_layers": 2, "mask_token_id": 9, "selector_rank": 8, "anchors": 100, **options}
    return build_dflash2(DraftConfig(head="dflash2", options=DFlash2Options(**options)), target)


def features(target: Target, T: int = 20, seed: int = 6):
    ids = torch.randint(3, 128, (1, T), generator=torch.Generator().manual_seed(seed))
    out = target(ids)
    return ids, out, Features(input_ids=ids, loss_mask=torch.ones_like(ids), aux_hidden_states=out.aux_hidden_states,
                              last_hidden_state=out.last_hidden_state)


def drafter_at(head, out, ids, a: int, cls=DFlash2Drafter):
    """A drafter that committed positions < a, its bonus token a: the block training runs at anchor a."""
    drafter = cls(head, 64)
    drafter._commit(out.aux_hidden_states[:, :a])
    drafter.bonus = int(ids[0, a])
    return drafter


def test_a_fresh_dflash2_head_drafts_as_a_dflash_head_with_its_layers(target):
    """Identity convolutions and a selector adding nothing: the same block outputs and the same drafts."""
    head = dflash2(target)
    plain = build_dflash(DraftConfig(head="dflash", options=DFlashOptions(block_size=4, num_layers=2, mask_token_id=9)),
                         target)
    randomize(plain, 3)
    missing, unexpected = head.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and all("conv" in k or "candidate_selector" in k for k in missing)
    ids, out, _ = features(target)
    for a in (4, 11):
        torch.testing.assert_close(drafter_at(head, out, ids, a)._block_out(),
                                   drafter_at(plain, out, ids, a, DFlashDrafter)._block_out(), rtol=1e-5, atol=1e-5)
        assert drafter_at(head, out, ids, a).propose(3).tolist() == drafter_at(plain, out, ids, a, DFlashDrafter).propose(3).tolist()


def test_training_blocks_are_the_drafters_and_the_convolution_stops_at_each_blocks_first_slot(target):
    head = dflash2(target)
    randomize(head, 1)
    ids, out, f = features(target)
    torch.manual_seed(0)
    blocks = head.block_drafts(f)
    for n in (0, 7, 15):  # blocks laid end to end in training: a block's slot 0 must not read the block before it
        a = int(blocks.anchors[0, n])
        torch.testing.assert_close(drafter_at(head, out, ids, a)._block_out(), blocks.drafts[0, n], rtol=1e-3, atol=2e-4)
    conv = head.layers[0].attention_conv  # and the formula itself, on two blocks of 4
    x, taps = torch.randn(1, 8, 32), conv.taps(torch.randn(1, 8, 32))
    want = torch.zeros(1, 8, 32)
    for t in range(8):
        for j in range(2):
            if t % 4 >= j:
                weight = conv.base_kernel[1, j] + taps[0, t, 1, j].repeat_interleave(16)
                want[0, t] += weight * x[0, t - j]
    torch.testing.assert_close(conv(x, 1, taps), want, rtol=1e-5, atol=1e-5)


def test_the_selector_walks_the_block_and_its_loss_is_the_candidates_cross_entropy(target):
    head = dflash2(target, selector_top_k=8)
    randomize(head, 2)
    ids, out, f = features(target)
    drafter = drafter_at(head, out, ids, 6)
    h = head.norm(drafter._block_out())
    unary = head.lm_head(h).float()
    prev, walk = int(ids[0, 6]), []
    sel = head.candidate_selector
    for j in range(3):  # score_c = unary_c + <P[prev] * W h_j, S[c]> over the top 8
        top, cands = unary[j].topk(8)
        scores = top + (sel.successor_codebook[cands] @ (sel.predecessor_codebook[prev] * sel.hidden_projection(h[j])))
        prev = int(cands[scores.argmax()])
        walk.append(prev)
    assert drafter.propose(3).tolist() == walk
    assert walk != unary[:3].argmax(-1).tolist()  # the selector changed a draft (else this would not test it)

    head.selector_alpha = 0.0
    torch.manual_seed(1)
    base, _ = head.loss(f)
    head.selector_alpha = 0.5
    torch.manual_seed(1)
    total, metrics = head.loss(f)
    torch.manual_seed(1)
    blocks = head.block_drafts(f)
    weights = head.draft_weights(head.projection(), blocks, f)
    want = 0.0
    with torch.no_grad():
        for n in range(blocks.anchors.shape[1]):
            a = int(blocks.anchors[0, n])
            for j in range(1, 4):
                if not blocks.trained[j - 1][0, n]:
                    continue
                h = head.norm(blocks.drafts[0, n, j - 1])[None]
                cands, scores = sel.scores(h, head.lm_head(h).float(), ids[0, a + j - 1 : a + j])
                greedy = head.lm_head(f.last_hidden_state[0, a + j - 1]).argmax()  # the target's token a+j
                hit = (cands[0] == greedy).nonzero()
                if len(hit):
                    want += float(weights[0, n, j - 1]) * float(F.cross_entropy(scores, hit[0]))
    assert (total - base).item() == pytest.approx(0.5 * want / float(loss_denominator(f)), rel=1e-4)
    assert 0 < metrics["selector_in_topk"] <= 1 and 0 <= metrics["selector_acc"] <= metrics["selector_in_topk"]


def test_z_labs_names_are_written_and_bad_configs_refused_by_name(target, tmp_path):
    head = dflash2(target)
    head.save_pretrained(tmp_path, dtype=torch.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["is_causal"] is False
    assert {k: config["dflash_config"][k] for k in ("block_size", "conv_kernel_size", "conv_group_size", "selector_rank",
                                                   "selector_top_k")} == {"block_size": 4, "conv_kernel_size": 2,
                                                                          "conv_group_size": 16, "selector_rank": 8,
                                                                          "selector_top_k": 16}
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert tensors["candidate_selector.predecessor_codebook"].shape == (128, 8)  # no ".weight": z-lab's and vLLM's name
    assert tensors["layers.1.mlp_conv.base_kernel"].shape == (2, 2, 32)
    assert tensors["layers.1.attention_conv.kernel_projection.weight"].shape == (2 * 2 * 2, 32)
    DFlash2Draft.load(tmp_path, target)
    bad = json.loads(json.dumps(config))
    bad["dflash_config"]["conv_group_size"] = 12
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="conv_group_size 12 must divide hidden_size 32"):
        DFlash2Draft.load(tmp_path, target)
    del bad["dflash_config"]["selector_rank"]
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"a DFlash2 config needs \['selector_rank'\]"):
        DFlash2Draft.load(tmp_path, target)


def test_a_target_vocab_smaller_than_the_selectors_top_k_builds_with_every_token_a_candidate():
    """The default top 16 over an 8-token vocab (the sampling test's target): clamped when the config is built, not
    refused by the config's own check on its defaults."""
    small = Target(tiny_causal_lm("llama", num_hidden_layers=8, vocab_size=8))
    head = build_dflash2(DraftConfig(head="dflash2", options=DFlash2Options(num_layers=1)), small)
    assert head.config.selector_top_k == 8 and head.config.vocab_size == 8
