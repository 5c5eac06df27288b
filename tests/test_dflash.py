"""DFlash (heads/dflash): a block of masked positions filled by one forward over the target's hidden states --
training and decoding computing the same block, greedy-exact decoding (chains of the block and shorter, trees,
batches), the trainer carrying it, z-lab's layout written and read back, and bad configs refused by name."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tiny_models import randomize, tiny_causal_lm

from headstart.decode.batch_generate import batch_speculative_generate
from headstart.decode.generate import greedy_generate, speculative_generate
from headstart.decode.target_runner import RaggedRunner, TargetRunner
from headstart.decode.tree import DynamicTree
from headstart.heads.dflash.config import DFlashConfig, DFlashOptions
from headstart.heads.dflash.drafter import DFlashDrafter
from headstart.heads.dflash.module import BlockDrafts, DFlashDraft, build_dflash
from headstart.heads.exports import check_head, detect_layout
from headstart.models.export import export_head
from headstart.models.head import DraftConfig, Features
from headstart.models.provenance import fingerprint
from headstart.models.target import Target


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return Target(tiny_causal_lm("llama", num_hidden_layers=8))


def random_dflash(target, block_size: int = 5, num_layers: int = 2, seed: int = 0, **options) -> DFlashDraft:
    head = build_dflash(DraftConfig(head="dflash", options=DFlashOptions(block_size=block_size, num_layers=num_layers,
                                                                       mask_token_id=9, **options)), target)
    randomize(head, seed)
    return head


def features(target: Target, T: int = 20, seed: int = 6) -> tuple[torch.Tensor, object, Features]:
    ids = torch.randint(3, 128, (1, T), generator=torch.Generator().manual_seed(seed))
    out = target(ids)
    return ids, out, Features(input_ids=ids, loss_mask=torch.ones_like(ids), aux_hidden_states=out.aux_hidden_states,
                              last_hidden_state=out.last_hidden_state)


def test_a_drafter_block_equals_the_training_block_at_its_anchor(target):
    """The block the drafter runs after committing positions < a, bonus token a, is the block training runs at anchor a
    (same context visibility, positions and bidirectional attention): the same slot outputs."""
    head = random_dflash(target, anchors=100)
    ids, out, f = features(target)
    torch.manual_seed(0)
    anchors, real = head.pick_anchors(f)
    assert real.all() and anchors.shape[1] == 18  # positions 1..18: context before, next token trained
    T, Bk = 20, 5
    tokens = torch.full((1, 18, Bk), 9)
    tokens[:, :, 0] = ids.gather(1, anchors)
    ctx_ok = torch.arange(T)[None, None, :] < anchors[:, :, None]
    own = torch.block_diag(*[torch.ones(Bk, Bk, dtype=torch.bool)] * 18)
    allowed = torch.cat([ctx_ok.repeat_interleave(Bk, 1), own[None]], dim=2)
    with torch.no_grad():
        context = head.context_kv(head.context(f.aux_hidden_states), f.positions())
        train = head.blocks(tokens.view(1, -1), (anchors[:, :, None] + torch.arange(Bk)).view(1, -1), context, allowed)
        train = head.logits(train.view(1, 18, Bk, -1)[:, :, 1:])
    for a in (1, 7, 15):
        drafter = DFlashDrafter(head, 64)
        drafter.begin(ids[:, :a], out.select(slice(0, a)), int(ids[0, a]))
        torch.testing.assert_close(drafter._block(), train[0, a - 1].float(), rtol=1e-4, atol=1e-4)


def test_loss_trains_each_slot_on_the_target_at_its_position_and_decreases():
    """On a target with peaked distributions (a random tiny target's are near uniform, and the draft reads through the
    same lm_head): the loss falls, and each of the B-1 slots is trained at up to ``anchors`` blocks."""
    model = tiny_causal_lm("llama", num_hidden_layers=8)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    target = Target(model)
    head = random_dflash(target, anchors=8)
    _, _, f = features(target, T=24)
    loss, metrics = head.loss(f)
    assert {"acc_0", "acc_3", "sim_accept_len"} <= set(metrics) and "acc_4" not in metrics  # B-1 = 4 slots
    assert metrics["sum/valid_0"] == 8 and metrics["sum/valid_3"] <= 8
    optim = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for step in range(20):
        torch.manual_seed(step % 2)  # two fixed anchor draws
        loss, _ = head.loss(f)
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    assert not head.embed_tokens.weight.requires_grad


def test_dpace_weights_are_the_expected_accepted_slots_from_each_on(target):
    """D-PACE (speculators' dpace_loss_decay), recomputed slot by slot: s_j = (1 - alpha) q_j + alpha with q_j the
    draft's probability of the target's argmax, P_k = s_1...s_k, w_k = sum_{j >= k} P_j over trained slots; alpha = 1
    counts the trained slots from k on."""
    head = random_dflash(target, anchors=6, weighting="dpace", dpace_alpha=0.3)
    _, _, f = features(target, T=12)  # short: the last anchors' blocks run past the end, untrained there
    torch.manual_seed(0)
    anchors, real = head.pick_anchors(f)
    Bk, (B, N), T = 5, anchors.shape, 12
    with torch.no_grad():
        tokens = torch.full((B, N, Bk), 9)
        tokens[:, :, 0] = f.input_ids.gather(1, anchors)
        ctx_ok = torch.arange(T)[None, None, :] < anchors[:, :, None]
        own = torch.block_diag(*[torch.ones(Bk, Bk, dtype=torch.bool)] * N)
        allowed = torch.cat([ctx_ok.repeat_interleave(Bk, 1), own[None]], dim=2)
        context = head.context_kv(head.context(f.aux_hidden_states), f.positions())
        out = head.blocks(tokens.view(B, -1), (anchors[:, :, None] + torch.arange(Bk)).view(B, -1), context, allowed)
        out = out.view(B, N, Bk, -1)
        trained = [real & (anchors + i < T) for i in range(1, Bk)]
        got = head.dpace_weights(lambda h: head.logits(h).float(), BlockDrafts(anchors, out[:, :, 1:], trained), f)
        for n in range(N):
            a = int(anchors[0, n])
            m = [bool(t[0, n]) for t in trained]
            s = []
            for j in range(Bk - 1):
                if not m[j]:
                    s.append(1.0)
                    continue
                q = head.logits(out[0, n, j + 1]).softmax(-1)[head.lm_head(f.last_hidden_state[0, a + j]).argmax()]
                s.append(0.7 * float(q) + 0.3)
            P = [math.prod(s[: j + 1]) for j in range(Bk - 1)]
            want = [sum(P[j] for j in range(k, Bk - 1) if m[j]) if m[k] else 0.0 for k in range(Bk - 1)]
            torch.testing.assert_close(got[0, n], torch.tensor(want), rtol=1e-5, atol=1e-6)
        assert any(not all(bool(t[0, n]) for t in trained) for n in range(N))  # a block cut by the end is covered
        head.dpace_alpha = 1.0
        counts = head.dpace_weights(lambda h: head.logits(h).float(), BlockDrafts(anchors, out[:, :, 1:], trained), f)
        m = torch.stack(trained, -1).float()
        torch.testing.assert_close(counts, m.flip(-1).cumsum(-1).flip(-1) * m)
    # and it trains
    loss, _ = head.loss(f)
    loss.backward()
    assert head.fc.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="draft.weighting must be decay or dpace"):
        random_dflash(target, weighting="uniform")
    with pytest.raises(ValueError, match=r"draft.dpace_alpha must be in \(0, 1\]"):
        random_dflash(target, weighting="dpace", dpace_alpha=0.0)


def test_decoding_is_greedy_exact_in_chains_trees_and_batches(target):
    head = random_dflash(target, block_size=6)
    runner = TargetRunner(target, max_len=128)
    prompts = [torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in (11, 6, 9)]
    plain = [greedy_generate(runner, p, 30, set()).tokens for p in prompts]
    for k in (1, 3, 5, 8):  # k past the block drafts its B-1
        out = speculative_generate(runner, DFlashDrafter(head, 128), prompts[0], 30, set(), k=k)
        assert out.tokens == plain[0] and max(out.proposed) <= min(k, 5)
    tree = DynamicTree(depth=3, topk=2, total_tokens=6)
    assert speculative_generate(runner, DFlashDrafter(head, 128), prompts[0], 30, set(), k=4, tree=tree).tokens == plain[0]
    outs, _ = batch_speculative_generate(RaggedRunner(target, 128), DFlashDrafter(head, 128), prompts, 30, set(), 4)
    assert [o.tokens for o in outs] == plain
    with pytest.raises(ValueError, match="drafts 5 tokens\\); a tree deeper than 5"):
        speculative_generate(runner, DFlashDrafter(head, 128), prompts[0], 30, set(), k=4,
                             tree=DynamicTree(depth=6, topk=1, total_tokens=6))


def test_a_compiled_drafter_drafts_as_the_eager_one(target):
    """``--compile`` (dynamo's eager backend here): one dynamic-shape graph for the block, the same drafts and tokens."""
    torch._dynamo.reset()
    head = random_dflash(target, block_size=6)
    runner = TargetRunner(target, max_len=128)
    prompt = torch.randint(3, 128, (1, 11), generator=torch.Generator().manual_seed(11))
    want = speculative_generate(runner, DFlashDrafter(head, 128), prompt, 24, set(), k=5)
    got = speculative_generate(runner, DFlashDrafter(head, 128, compile=True, backend="eager"), prompt, 24, set(), k=5)
    assert got.tokens == want.tokens and got.accepted == want.accepted


def test_the_z_lab_layout_is_written_detected_and_read_back_to_the_same_logits(target, tmp_path):
    head = random_dflash(target)
    root = tmp_path / "target"
    target.model.save_pretrained(root)
    export_head(head, tmp_path / "out", "dflash", fingerprint(root))
    d = json.loads((tmp_path / "out" / "config.json").read_text())
    assert d["architectures"] == ["DFlashDraftModel"] and d["block_size"] == 5 and d["num_target_layers"] == 8
    assert d["dflash_config"] == {"mask_token_id": 9, "target_layer_ids": [i - 1 for i in target.aux_layer_ids]}
    assert d["layer_types"] == ["full_attention"] * 2
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "out" / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_norm.weight"} <= names
    assert not any(n.startswith(("embed_tokens", "lm_head", "rotary")) for n in names)  # the target's
    assert detect_layout(tmp_path / "out") == ("dflash", "dflash")
    assert check_head(tmp_path / "out", root)[1] == []
    back = DFlashDraft.load(tmp_path / "out", target)
    ids, out, _ = features(target)
    blocks = []
    for h in (head, back):
        drafter = DFlashDrafter(h.float(), 64)
        drafter.begin(ids[:, :9], out.select(slice(0, 9)), int(ids[0, 9]))
        blocks.append(drafter._block())
    torch.testing.assert_close(blocks[1], blocks[0], rtol=1e-2, atol=1e-2)  # bf16 weights
    # a missing tensor is named
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    from safetensors.torch import save_file

    save_file({k: v for k, v in tensors.items() if k != "hidden_norm.weight"}, str(tmp_path / "out" / "model.safetensors"))
    assert "missing ['hidden_norm.weight']" in check_head(tmp_path / "out", root)[1][0].message


def test_bad_configs_are_refused_by_name(target):
    flat = DFlashConfig.from_target(target.config, block_size=8, mask_token_id=3).to_hf_dict()
    assert DFlashConfig.from_hf_dict(flat).aux_layer_ids == target.aux_layer_ids
    with pytest.raises(ValueError, match="dflash_config.mask_token_id is missing"):
        DFlashConfig.from_hf_dict({**flat, "dflash_config": {"target_layer_ids": [1, 3, 4]}})
    with pytest.raises(ValueError, match="sliding or causal layers are not implemented"):
        DFlashConfig.from_hf_dict({**flat, "layer_types": ["sliding_attention"]})
    with pytest.raises(ValueError, match="causal is true"):
        DFlashConfig.from_hf_dict({**flat, "dflash_config": {**flat["dflash_config"], "causal": True}})
    other = tiny_causal_lm("llama", num_hidden_layers=6).config
    with pytest.raises(ValueError, match="num_target_layers 8 != the target's 6"):
        DFlashConfig.from_hf_dict(flat).check_target(other)
    with pytest.raises(ValueError, match="block_size 1: a block holds the bonus token"):
        DFlashConfig.from_target(target.config, block_size=1).check_target(target.config)
    with pytest.raises(ValueError, match="draft.anchors must be >= 1"):
        build_dflash(DraftConfig(head="dflash", options=DFlashOptions(anchors=0)), target)


@pytest.mark.slow
def test_dflash_trains_alike_on_fsdp_and_zero3_and_exports_z_labs_layout(tmp_path):
    """The shared trainer carries DFlash: 2-rank FSDP2 and ZeRO-3 agree step for step (every candidate anchor trained:
    the draws are the same on both), the integrated decode evaluation drafts with its drafter, both export the
    z-lab layout."""
    from test_distributed import fsdp_and_zero3_evals

    runs = fsdp_and_zero3_evals(tmp_path, "dflash", ["--train.save_every=3"])
    for name, evals in runs.items():
        assert evals and all(1.0 <= r["decode_tau"] <= 4.0 for r in evals)
        assert detect_layout(tmp_path / name / "final") == ("dflash", "dflash")
