"""headstart's DFlash exports decoded by z-lab's own code (the ``dflash`` package, MIT): its ``DFlashDraftModel`` loads
the export and its ``dflash_generate`` loop, greedy, must emit exactly the tokens headstart's decoder emits with the
same head -- accepting as many drafts in every round, so the two loops draft the same blocks -- and its forward of the
export must give headstart's logits for each prompt's first block.

dflash runs in its own virtual environment (tests/dflash_env.py: its model code is tied to an older transformers);
tests/zlab_reader.py loads and decodes there. The committed demo DFlash head accepts ~2.5 tokens a forward on the demo
target, so agreeing forward counts is a check that every draft slot matches, not only the bonus tokens."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from dflash_env import dflash_python
from tiny_models import randomize, tiny_causal_lm

from headstart.decode.generate import greedy_generate, speculative_generate
from headstart.decode.target_runner import TargetRunner
from headstart.heads.dflash2.config import DFlash2Options
from headstart.heads.registry import build_head, drafter_for, load_head
from headstart.models.export import export_head
from headstart.models.head import DraftConfig
from headstart.models.provenance import fingerprint
from headstart.models.target import Target, TargetConfig, load_tokenizer

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo"
READER = Path(__file__).with_name("zlab_reader.py")
NEW_TOKENS = 48


def read_with_zlab(tmp_path: Path, head: Path, target: Path, prompts: list[list[int]]) -> dict:
    request = {"head": str(head), "target": str(target), "prompts": prompts, "max_new_tokens": NEW_TOKENS,
               "report": str(tmp_path / "report.json")}
    (tmp_path / "request.json").write_text(json.dumps(request))
    run = subprocess.run([str(dflash_python()), str(READER), str(tmp_path / "request.json")], capture_output=True,
                         text=True, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads((tmp_path / "report.json").read_text())


def first_blocks(head, target: Target, prompts: list, max_len: int) -> tuple[list[list[int]], torch.Tensor]:
    """headstart's drafter on the block after each prompt: its greedy drafts and the slots' logits before any selector
    [prompts, B-1, V] (what tests/zlab_reader.py reports for z-lab's)."""
    runner, blocks, unary = TargetRunner(target, max_len=max_len, with_aux=True), [], []
    for ids in prompts:
        prompt, drafter = torch.tensor([ids]), drafter_for(head, max_len)
        runner.reset()
        logits, states = runner.forward(prompt)
        runner.commit(prompt.shape[1])
        drafter.begin(prompt, states, int(logits[0, -1].argmax()))
        blocks.append(drafter.propose(head.config.block_size - 1).tolist())
        unary.append(drafter._block())
    return blocks, torch.stack(unary)


def assert_same_logits(report: dict, ours: torch.Tensor) -> None:
    """z-lab's forward of the export gives headstart's logits for every slot of every first block (float32; the two
    attention implementations differ in rounding only)."""
    theirs = torch.load(report["first_logits"])
    assert theirs.shape == ours.shape, (theirs.shape, ours.shape)
    assert ours.std() > 0.1  # real logits, not a constant
    assert torch.allclose(theirs, ours, rtol=1e-4, atol=1e-3), (theirs - ours).abs().max()


def assert_same_rounds(report: dict, ours: list, k: int) -> None:
    """Round by round, z-lab's loop accepted as many drafts as headstart's (it reports accepted + 1 a forward), over the
    rounds where headstart drafted a whole block: near the length limit headstart drafts only what still fits, z-lab a
    whole block, so their last rounds differ in what they verify (not in what they draft)."""
    for theirs, got in zip(report["acceptance"], ours):
        full = [i for i, n in enumerate(got.proposed) if n == k and i < len(theirs)]
        assert len(full) >= len(got.proposed) - k - 1, got.proposed  # only the last few rounds are short
        assert [theirs[i] for i in full] == [got.accepted[i] + 1 for i in full], (theirs, got.accepted)


def test_z_labs_loop_decodes_the_committed_dflash_head_to_headstarts_tokens_round_by_round(tmp_path):
    tokenizer = load_tokenizer(str(DEMO / "target"))
    questions = [json.loads(line)["turns"][0] for line in (DEMO / "eval" / "mt_bench.jsonl").read_text().splitlines()[:4]]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             return_dict=True)["input_ids"] for q in questions]
    target = Target.from_pretrained(TargetConfig(path=str(DEMO / "target"), dtype="float32"))
    head = load_head("dflash", str(DEMO / "dflash-head"), target).eval()
    runner = TargetRunner(target, max_len=512, with_aux=True)
    k = head.config.block_size - 1
    ours = []
    for ids in prompts:
        prompt = torch.tensor([ids])
        got = speculative_generate(runner, drafter_for(head, 512), prompt, NEW_TOKENS, set(), k=k)
        assert got.tokens == greedy_generate(runner, prompt, NEW_TOKENS, set()).tokens  # (headstart's own check)
        ours.append(got)

    blocks, unary = first_blocks(head, target, prompts, 512)
    report = read_with_zlab(tmp_path, DEMO / "dflash-head", DEMO / "target", prompts)
    assert report["class"] == "DFlashDraftModel" and report["block_size"] == head.config.block_size
    assert report["missing"] == [] and report["unexpected"] == []
    assert report["first_block"] == blocks
    assert_same_logits(report, unary)
    assert report["outputs"] == [g.tokens for g in ours]
    assert_same_rounds(report, ours, k)
    tau = sum(len(g.tokens) for g in ours) / sum(len(g.proposed) for g in ours)
    assert tau > 1.5, tau  # the head really drafts here: most slots' drafts are compared, not only bonus tokens


def test_z_labs_dflash2_class_loads_a_dflash2_export_and_drafts_its_blocks(tmp_path):
    """A random DFlash2 head (convolutions and selector moved off their identity start) for a tiny Qwen3 target: z-lab's
    ``DFlash2DraftModel`` loads every tensor, drafts each prompt's first block as headstart's drafter does (the
    selector's greedy walk), and its loop emits headstart's tokens, accepting as many drafts round by round."""
    torch.manual_seed(0)
    model = tiny_causal_lm("qwen3", num_hidden_layers=8, hidden_size=64, head_dim=16)
    with torch.no_grad():  # peaked logits: no near-ties (a random tiny target's top two can be 1e-6 apart, and two
        model.lm_head.weight.mul_(20.0)  # implementations' float32 rounding may break such a tie either way)
    model.save_pretrained(tmp_path / "target")
    target = Target.from_pretrained(TargetConfig(path=str(tmp_path / "target"), dtype="float32"))
    head = build_head(DraftConfig(head="dflash2", options=DFlash2Options(block_size=5, num_layers=2, mask_token_id=3,
                                                                        selector_rank=8, selector_top_k=16)),
                      target, torch.ones(target.config.vocab_size))
    randomize(head, 1)  # every tensor random, so a misplaced one shows in the drafts
    with torch.no_grad():  # the selector's term as large as the unary logits' gaps: it picks other tokens than the argmax
        head.candidate_selector.successor_codebook.mul_(20.0)
    export_head(head, tmp_path / "head", "dflash2", fingerprint(tmp_path / "target"))
    prompts = [torch.randint(3, 120, (9,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(4)]
    runner = TargetRunner(target, max_len=128, with_aux=True)
    head = load_head("dflash2", str(tmp_path / "head"), target).eval()
    blocks, unary = first_blocks(head, target, prompts, 128)
    ours = [speculative_generate(runner, drafter_for(head, 128), torch.tensor([ids]), NEW_TOKENS, set(), k=4)
            for ids in prompts]

    report = read_with_zlab(tmp_path, tmp_path / "head", tmp_path / "target", prompts)
    assert report["class"] == "DFlash2DraftModel" and report["missing"] == [] and report["unexpected"] == []
    assert report["first_block"] == blocks, (report["first_block"], blocks)
    assert_same_logits(report, unary)
    assert blocks != unary.argmax(-1).tolist()  # the selector changed drafts: z-lab's and headstart's agree where it matters
    assert report["outputs"] == [g.tokens for g in ours]
    assert_same_rounds(report, ours, 4)
