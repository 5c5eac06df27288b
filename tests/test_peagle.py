"""P-EAGLE (heads/peagle): EAGLE-3's network drafting a round's k tokens in one forward from placeholder pairs --
training and decoding computing the same thing, greedy-exact decoding (chains, trees, batches), the trainer carrying
it (FSDP2 and ZeRO-3), both export layouts read back, vLLM's keys written, and bad configs refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from test_eagle31 import features
from tiny_models import random_eagle3_head, random_peagle_head, tiny_causal_lm

from headstart.decode.generate import greedy_generate, speculative_generate
from headstart.decode.target_runner import TargetRunner
from headstart.decode.tree import DynamicTree, StaticTree
from headstart.heads.eagle3.check import detect_eagle3
from headstart.heads.exports import check_head, convert_head, detect_layout
from headstart.heads.peagle.config import PEagleConfig, PEagleOptions
from headstart.heads.peagle.drafter import PEagleDrafter
from headstart.heads.peagle.module import PEagleDraft, build_peagle
from headstart.models.export import export_head
from headstart.models.head import DraftConfig, Features
from headstart.models.provenance import fingerprint
from headstart.models.target import Target


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return Target(tiny_causal_lm("llama", num_hidden_layers=8))


def test_depths_read_the_placeholder_pair_not_the_previous_depth(target):
    """Depth d >= 1's input is (fc(mask_hidden), mask token) whatever the data's tokens: changing token t+2 changes no
    depth >= 1 output at t, while EAGLE-3's step 1 (which reads it) changes."""
    head = random_peagle_head(target, parallel_tokens=3, mask_token_id=5)
    ids, out, f = features(target)
    other = ids.clone()
    other[0, 6] = (ids[0, 6] + 1) % 128
    g = Features(input_ids=other, loss_mask=f.loss_mask, aux_hidden_states=f.aux_hidden_states,
                 target_logits=f.target_logits, target_in_draft=f.target_in_draft)
    with torch.no_grad():
        a, b = list(head.unroll(f)), list(head.unroll(g))
    # position 4: depth 0 reads token 5 (unchanged); depths 1, 2 read placeholders, and attend to depth 0's keys <= 4
    for k in range(3):
        torch.testing.assert_close(a[k][0, 4], b[k][0, 4])
    eagle3 = random_eagle3_head(target, ttt_steps=3)
    eagle3.load_state_dict({k: v for k, v in head.state_dict().items() if k != "mask_hidden"})
    with torch.no_grad():
        assert (list(eagle3.unroll(f))[1][0, 4] - list(eagle3.unroll(g))[1][0, 4]).abs().max() > 1e-3
    placeholder = head.placeholder()
    torch.testing.assert_close(placeholder, head.fc(head.mask_hidden))  # through fc as a real feature is


@pytest.mark.parametrize("fc_norm", [False, True])
def test_one_drafter_round_gives_the_training_depths_logits(target, fc_norm):
    """Decoding runs what training runs: the round's k logits at position t are depths 0..k-1's logits at t."""
    head = random_peagle_head(target, parallel_tokens=4, mask_token_id=9, fc_norm=fc_norm)
    ids, out, f = features(target)
    with torch.no_grad():
        depths = list(head.unroll(f))
    for t in (3, 9):
        drafter = PEagleDrafter(head, 64)
        drafter.begin(ids[:, : t + 1], out.select(slice(0, t + 1)), int(ids[0, t + 1]))
        logits = drafter._round(4)
        assert logits.shape[0] == 4 and drafter.length == t + 1  # the placeholders' slots are not committed
        for k in range(4):
            torch.testing.assert_close(logits[k].float(), depths[k][0, t], rtol=1e-4, atol=1e-4)


def test_a_round_after_a_commit_equals_one_over_the_whole_prefix(target):
    """Held commits: a round after begin + update reads the same as a round after begin on the longer prefix, so the
    placeholders' speculative slots never leak into the next round."""
    head = random_peagle_head(target, parallel_tokens=4, mask_token_id=9)
    ids, out, _ = features(target)
    stepwise = PEagleDrafter(head, 64)
    stepwise.begin(ids[:, :5], out.select(slice(0, 5)), int(ids[0, 5]))
    stepwise.propose(4)
    stepwise.update(ids[0, 6:9].tolist(), out.select(slice(5, 8)))
    whole = PEagleDrafter(head, 64)
    whole.begin(ids[:, :8], out.select(slice(0, 8)), int(ids[0, 8]))
    torch.testing.assert_close(stepwise._round(4), whole._round(4), rtol=1e-5, atol=1e-5)
    # a second round on the same commit (decode/predict.py times repeated proposals) drafts the same, commits nothing
    length = whole.length
    torch.testing.assert_close(whole._round(4), stepwise._round(4), rtol=1e-5, atol=1e-5)
    assert whole.length == length


def test_decoding_is_greedy_exact_in_chains_and_trees(target):
    head = random_peagle_head(target, parallel_tokens=5, mask_token_id=9)
    runner = TargetRunner(target, max_len=128)
    prompt = torch.randint(3, 128, (1, 11), generator=torch.Generator().manual_seed(5))
    plain = greedy_generate(runner, prompt, 30, set()).tokens
    for k in (1, 3, 5, 8):  # k past the trained depths drafts the depths it has
        out = speculative_generate(runner, PEagleDrafter(head, 128), prompt, 30, set(), k=k)
        assert out.tokens == plain and max(out.proposed) <= min(k, 5)
    for tree in (DynamicTree(depth=3, topk=2, total_tokens=6), StaticTree(((0,), (1,), (0, 0), (1, 0), (0, 0, 0)))):
        assert speculative_generate(runner, PEagleDrafter(head, 128), prompt, 30, set(), k=4, tree=tree).tokens == plain
    with pytest.raises(ValueError, match="drafts 5 tokens a round; a tree deeper than 5"):
        speculative_generate(runner, PEagleDrafter(head, 128), prompt, 30, set(), k=4,
                             tree=DynamicTree(depth=6, topk=1, total_tokens=6))


def test_a_trained_head_drafts_what_its_depths_learned(target):
    """Training moves the placeholder: a few steps on one batch lower the loss and change mask_hidden."""
    head = random_peagle_head(target, parallel_tokens=3, mask_token_id=9)
    ids, out, f = features(target, T=24)
    f = Features(input_ids=ids, loss_mask=f.loss_mask, aux_hidden_states=out.aux_hidden_states,
                 target_logits=torch.randn(1, 24, 48, generator=torch.Generator().manual_seed(2)) * 3,
                 target_in_draft=f.target_in_draft)
    before = head.mask_hidden.detach().clone()
    optim = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(25):
        loss, metrics = head.loss(f)
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    assert (head.mask_hidden - before).abs().max() > 1e-3
    assert not head.embed_tokens.weight.requires_grad  # the target's embedding stays the servers' one


@pytest.mark.parametrize("layout", ["flat", "speculators"])
def test_both_layouts_write_vllms_keys_and_read_back_to_the_same_logits(target, tmp_path, layout):
    head = random_peagle_head(target, parallel_tokens=3, mask_token_id=11, fc_norm=True)
    head.save_pretrained(tmp_path, dtype=torch.float32, layout=layout,
                         verifier={"name_or_path": "some/target", "architectures": ["LlamaForCausalLM"]})
    d = json.loads((tmp_path / "config.json").read_text())
    assert d["mask_token_id"] == 11 and d["fc_norm"] is True
    if layout == "flat":
        assert d["pard_token"] == 11 and d["architectures"] == ["LlamaForCausalLMEagle3"]
        assert detect_eagle3(tmp_path, d) is None  # not an EAGLE-3 head to the catalog
    else:
        assert d["speculators_model_type"] == "peagle" and d["architectures"] == ["PEagleSpeculator"]
        assert d["speculators_config"]["algorithm"] == "peagle"
    back = PEagleDraft.from_pretrained(tmp_path, target_embeddings=target.embed_tokens.weight, ttt_steps=3)
    assert back.config == head.config
    _, _, f = features(target)
    with torch.no_grad():
        for got, want in zip(back.unroll(f), head.unroll(f)):
            torch.testing.assert_close(got, want)


def test_export_detect_convert_and_check(target, tmp_path):
    head = random_peagle_head(target, parallel_tokens=3, mask_token_id=11)
    root = tmp_path / "target"
    target.model.save_pretrained(root)
    export_head(head, tmp_path / "flat", "peagle", fingerprint(root))
    assert detect_layout(tmp_path / "flat") == ("peagle", "flat")
    assert check_head(tmp_path / "flat", root)[1] == []
    convert_head(tmp_path / "flat", tmp_path / "spec", "speculators", fingerprint(root))
    assert detect_layout(tmp_path / "spec") == ("peagle", "speculators")
    assert check_head(tmp_path / "spec", root)[1] == []
    # what vLLM would get wrong, by key
    d = json.loads((tmp_path / "flat" / "config.json").read_text())
    (tmp_path / "flat" / "config.json").write_text(json.dumps({**d, "pard_token": 12}))
    problems = check_head(tmp_path / "flat", root)[1]
    assert [p.key for p in problems] == ["pard_token"]
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "spec" / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != "mask_hidden"}, str(tmp_path / "spec" / "model.safetensors"))
    problems = check_head(tmp_path / "spec", root)[1]
    assert [(p.key, p.message.split(":")[0]) for p in problems] == [("mask_hidden", "missing")]


def test_a_multi_layer_draft_decodes_what_it_trains_and_exports_vllms_layer_names(target, tmp_path):
    """The P-EAGLE paper's multi-layer drafter (vLLM's and speculators' multi-layer EAGLE-3): layer 0 reads
    cat(embeds, hidden), layers 1.. are plain Llama layers on its output. A drafter round gives the training depths'
    logits; greedy decoding is exact; both layouts name the later layers layers.{i} (vLLM's), read back to the same
    logits, and pass check_head; a tensor missing from a later layer is named."""
    head = random_peagle_head(target, parallel_tokens=4, mask_token_id=9, num_layers=3)
    with torch.no_grad():  # weights bf16 can hold: the export (bf16) then reads back exactly
        for name, p in head.named_parameters():
            if name != "embed_tokens.weight":  # the target's, not exported
                p.copy_(p.bfloat16().float())
    assert [n for n in head.state_dict() if n.startswith("layers.")][:2] == ["layers.1.self_attn.q_proj.weight",
                                                                             "layers.1.self_attn.k_proj.weight"]
    assert head.layers["1"].self_attn.q_proj.in_features == target.config.hidden_size  # only layer 0 reads 2H
    ids, out, f = features(target)
    with torch.no_grad():
        depths = list(head.unroll(f))
        one = random_peagle_head(target, parallel_tokens=4, mask_token_id=9)
        one.load_state_dict({k: v for k, v in head.state_dict().items() if not k.startswith("layers.")})
        assert (list(one.unroll(f))[0] - depths[0]).abs().max() > 1e-3  # the later layers change what it drafts
    drafter = PEagleDrafter(head, 64)
    drafter.begin(ids[:, :8], out.select(slice(0, 8)), int(ids[0, 8]))
    logits = drafter._round(4)
    for k in range(4):
        torch.testing.assert_close(logits[k].float(), depths[k][0, 7], rtol=1e-4, atol=1e-4)
    runner = TargetRunner(target, max_len=128)
    prompt = torch.randint(3, 128, (1, 11), generator=torch.Generator().manual_seed(5))
    plain = greedy_generate(runner, prompt, 20, set()).tokens
    assert speculative_generate(runner, PEagleDrafter(head, 128), prompt, 20, set(), k=4).tokens == plain
    assert speculative_generate(runner, PEagleDrafter(head, 128), prompt, 20, set(), k=4,
                                tree=DynamicTree(depth=3, topk=2, total_tokens=6)).tokens == plain

    root = tmp_path / "target"
    target.model.save_pretrained(root)
    export_head(head, tmp_path / "flat", "peagle", fingerprint(root))
    convert_head(tmp_path / "flat", tmp_path / "spec", "speculators", fingerprint(root))
    from safetensors.torch import load_file, save_file

    for layout, first in (("flat", "midlayer."), ("spec", "layers.0.")):
        d = json.loads((tmp_path / layout / "config.json").read_text())
        assert (d.get("transformer_layer_config") or d)["num_hidden_layers"] == 3
        names = set(load_file(str(tmp_path / layout / "model.safetensors")))
        assert {first + "hidden_norm.weight", "layers.1.input_layernorm.weight", "layers.2.mlp.down_proj.weight"} <= names
        assert check_head(tmp_path / layout, root)[1] == []
        back = PEagleDraft.from_pretrained(tmp_path / layout, target_embeddings=target.embed_tokens.weight,
                                           ttt_steps=4).float()
        assert back.config.num_hidden_layers == 3
        with torch.no_grad():
            for got, want in zip(back.unroll(f), depths):
                torch.testing.assert_close(got, want)
    tensors = load_file(str(tmp_path / "flat" / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != "layers.2.mlp.up_proj.weight"},
              str(tmp_path / "flat" / "model.safetensors"))
    assert [(p.key, p.message.split(":")[0]) for p in check_head(tmp_path / "flat", root)[1]] == [
        ("layers.2.mlp.up_proj.weight", "missing")]


def test_bad_configs_are_refused_by_name(target):
    flat = PEagleConfig.from_target(target.config, 48, mask_token_id=3).to_hf_dict()
    PEagleConfig.from_hf_dict(flat)
    with pytest.raises(ValueError, match="neither mask_token_id nor pard_token"):
        PEagleConfig.from_hf_dict({k: v for k, v in flat.items() if k not in ("mask_token_id", "pard_token")})
    with pytest.raises(ValueError, match="pard_token 4 != mask_token_id 3"):
        PEagleConfig.from_hf_dict({**flat, "pard_token": 4})
    with pytest.raises(ValueError, match="norm_output is true"):
        PEagleConfig.from_hf_dict({**flat, "norm_output": True})
    with pytest.raises(ValueError, match="mask_token_id 999 is not a token of the target's vocab"):
        PEagleConfig.from_hf_dict({**flat, "mask_token_id": 999, "pard_token": 999}).check_target(target.config)
    counts = torch.ones(target.vocab_size)
    with pytest.raises(ValueError, match="parallel_tokens must be >= 1"):
        build_peagle(DraftConfig(head="peagle", options=PEagleOptions(draft_vocab_size=48, parallel_tokens=0)), target, counts)


def test_cod_trains_each_depth_on_a_falling_share_among_the_depth_befores_positions(target, tmp_path):
    """COD (down_sample_ratio r, floor r_min): depth d trained at ~max(r^d, r_min) of the positions, each depth's
    among the depth before's; the unroll runs depth d only there; evaluation and r = 1 train every depth everywhere."""
    head = random_peagle_head(target, parallel_tokens=5, down_sample_ratio=0.6, down_sample_ratio_min=0.2)
    assert [head.depth_share(d) for d in range(5)] == pytest.approx([1.0, 0.6, 0.36, 0.216, 0.2])
    valid = [torch.ones(4, 2000, dtype=torch.bool)] * 5
    valid[3] = valid[3].clone()
    valid[3][:, :100] = False  # a depth trained nowhere near the start still keeps the later depths possible there
    torch.manual_seed(1)
    kept = head.train().trained_positions(valid)
    shares = [k.float().mean().item() for k in kept]
    assert shares[0] == 1.0 and shares[1:] == pytest.approx([0.6, 0.36, 0.216 * 0.95, 0.2], abs=0.02)
    assert not kept[3][:, :100].any()
    assert all((kept[d] <= kept[d - 1]).all() for d in (1, 2, 3))  # nested where the data allows
    assert head.eval().trained_positions(valid) is valid
    with torch.no_grad():  # the trainer's held-out pass: no gradients, the head left in train mode
        assert head.train().trained_positions(valid) is valid

    # the unroll runs depth d at its own positions only: count the rows each depth's step is given
    from headstart.heads.eagle3.module import run_positions

    needed = run_positions(kept)
    assert [int(n.sum()) for n in needed] == [int((kept[1] | kept[2] | kept[3] | kept[4]).sum()),
                                              int((kept[2] | kept[3] | kept[4]).sum()),
                                              int((kept[3] | kept[4]).sum()), int(kept[4].sum())]
    ids, out, f = features(target, T=40)
    rows = []
    step = head.step
    head.step = lambda hidden, *a: rows.append(hidden.shape[1]) or step(hidden, *a)
    torch.manual_seed(3)
    loss, metrics = head.train().loss(f)
    loss.backward()
    # exactly where COD put each depth (the same draw again), far fewer than without it at the last depth
    full_valid = [torch.zeros(1, 40, dtype=torch.bool) for _ in range(5)]
    for d in range(5):
        full_valid[d][0, :38 - d] = True
    torch.manual_seed(3)
    assert rows == [40, *(int(n.sum()) for n in run_positions(head.trained_positions(full_valid)))]
    assert rows[-1] < rows[1] < 37  # (without COD: 37 and 34)
    assert torch.isfinite(loss) and head.mask_hidden.grad is not None and head.mask_hidden.grad.abs().sum() > 0
    rows.clear()
    full = random_peagle_head(target, parallel_tokens=5)  # r = 1: every depth everywhere, as before COD
    full.step = lambda hidden, *a: rows.append(hidden.shape[1]) or PEagleDraft.step(full, hidden, *a)
    full.train().loss(f)
    # depth d trains position t on token t + 2 + d: at the 38 - d positions that have one (it ran at 37 each before
    # each depth ran at its own positions)
    assert rows == [40, 37, 36, 35, 34]
    plan = lambda h: next(v for k, v in h.activation_bytes(4096, 4, 2).items() if k.startswith("head"))  # noqa: E731
    assert plan(head) < 0.6 * plan(full)  # 2.38 depths' worth of positions against 5
    # a rank whose last depth has nothing to train still runs every depth at one position (ZeRO-3 keeps in step)
    sparse = [torch.zeros(1, 6, dtype=torch.bool) for _ in range(5)]
    sparse[0][0, 2], sparse[1][0, 3] = True, True
    assert [int(n.sum()) for n in run_positions(sparse)] == [2, 1, 1, 1]
    counts = torch.ones(target.vocab_size)
    with pytest.raises(ValueError, match="down_sample_ratio .* must be in \\(0, 1\\]"):
        build_peagle(DraftConfig(head="peagle", options=PEagleOptions(draft_vocab_size=48, down_sample_ratio=0)),
                     target, counts)
    built = build_peagle(DraftConfig(head="peagle", options=PEagleOptions(draft_vocab_size=48, down_sample_ratio=0.7,
                                                                          num_layers=2)), target, counts)
    assert (built.down_sample_ratio, built.down_sample_ratio_min) == (0.7, 0.2)
    assert built.config.num_hidden_layers == 2 and len(built.later_layers()) == 1
    with pytest.raises(ValueError, match="draft.num_layers must be >= 1, got 0"):
        build_peagle(DraftConfig(head="peagle", options=PEagleOptions(draft_vocab_size=48, num_layers=0)), target, counts)
    one_layer = tmp_path / "config.json"
    one_layer.write_text(json.dumps(PEagleConfig.from_target(target.config, 48, mask_token_id=3).to_hf_dict()))
    with pytest.raises(ValueError, match="draft.num_layers is 2 but draft.config .* has num_hidden_layers 1"):
        build_peagle(DraftConfig(head="peagle", config=str(one_layer), options=PEagleOptions(draft_vocab_size=48,
                                                                                              num_layers=2)), target, counts)
    with pytest.raises(ValueError, match="num_hidden_layers is 0, not a count"):
        PEagleConfig.from_hf_dict({**json.loads(one_layer.read_text()), "num_hidden_layers": 0})


def test_recipe_fields_build_the_head_and_the_placeholder_defaults_to_pad_then_eos(target):
    counts = torch.ones(target.vocab_size)
    options = PEagleOptions(draft_vocab_size=48, parallel_tokens=6)
    head = build_peagle(DraftConfig(head="peagle", options=options), target, counts)
    assert head.ttt_steps == 6 and head.config.parallel_tokens == 6 and head.step_weight == 1.0
    assert target.config.pad_token_id is None and head.config.mask_token_id == target.config.eos_token_id == 2
    assert tuple(head.mask_hidden.shape) == (1, 1, 3 * target.config.hidden_size)
    padded = Target(tiny_causal_lm("llama", num_hidden_layers=8, pad_token_id=7))
    assert build_peagle(DraftConfig(head="peagle", options=options), padded, counts).config.mask_token_id == 7


@pytest.mark.slow
def test_peagle_trains_alike_on_fsdp_and_zero3_and_exports_the_servers_layout(tmp_path):
    """The shared trainer carries P-EAGLE: 2-rank FSDP2 and ZeRO-3 agree step for step, the integrated decode
    evaluation drafts with its drafter, and both write the flat layout with mask_hidden and the placeholder keys."""
    from test_distributed import fsdp_and_zero3_evals

    runs = fsdp_and_zero3_evals(tmp_path, "peagle", ["--train.save_every=3"])
    for name, evals in runs.items():
        assert evals and all(1.0 <= r["decode_tau"] <= 4.0 for r in evals)
        config = json.loads((tmp_path / name / "final" / "config.json").read_text())
        assert config["pard_token"] == config["mask_token_id"] and config["headstart"]["parallel_tokens"] == 3
        assert detect_layout(tmp_path / name / "final") == ("peagle", "flat")


@pytest.mark.slow
def test_a_compiled_drafter_decodes_as_the_eager_one(target):
    """``--compile`` (dynamo's eager backend here): the round's block compiled at its padded-free sizes, one drafter
    reused over two prompts, one sequence and a batch -- the same drafts, accepted as the eager drafter's."""
    from headstart.decode.batch_generate import batch_speculative_generate
    from headstart.decode.target_runner import RaggedRunner

    torch._dynamo.reset()
    head = random_peagle_head(target, parallel_tokens=4, mask_token_id=9)
    runner = TargetRunner(target, max_len=128)
    compiled = PEagleDrafter(head, 128, compile=True, backend="eager")
    compiled.precompile(5)
    assert set(range(1, 9)) <= compiled._commits.causal_sizes  # a commit of up to 5 and its 3 placeholders
    prompts = [torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in (11, 7)]
    for p in prompts:
        want = speculative_generate(runner, PEagleDrafter(head, 128), p, 30, set(), k=4)
        got = speculative_generate(runner, compiled, p, 30, set(), k=4)
        assert got.tokens == want.tokens == greedy_generate(runner, p, 30, set()).tokens
        assert got.accepted == want.accepted
    batch = PEagleDrafter(head, 128, compile=True, backend="eager")
    batch.precompile_batch(2, 5)
    ragged = RaggedRunner(target, 128)
    outs, _ = batch_speculative_generate(ragged, batch, prompts, 30, set(), 4)
    alone, _ = batch_speculative_generate(ragged, PEagleDrafter(head, 128), prompts, 30, set(), 4)
    assert [o.tokens for o in outs] == [o.tokens for o in alone]
    assert [o.accepted for o in outs] == [o.accepted for o in alone]
