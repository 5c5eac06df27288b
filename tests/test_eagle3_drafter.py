"""EAGLE-3 drafting at inference: exact output, and real acceptance with the committed demo head."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import random_eagle3_head, tiny_causal_lm

from headstart.heads.eagle3.drafter import Eagle3Drafter
from headstart.decode.generate import greedy_generate, speculative_generate
from headstart.decode.target_runner import TargetRunner
from headstart.models.draft_vocab import build_draft_vocab
from headstart.heads.eagle3.module import Eagle3Config, Eagle3Draft
from headstart.models.target import Target, TargetConfig, load_tokenizer

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("num_layers", [1, 2])
def test_eagle3_speculation_equals_greedy_with_any_head(num_layers):
    model = tiny_causal_lm("llama", num_hidden_layers=8)
    target = Target(model)
    head = random_eagle3_head(target, num_layers=num_layers)
    runner = TargetRunner(target, max_len=128)
    prompt = torch.randint(3, 128, (1, 11), generator=torch.Generator().manual_seed(5))
    for k in (1, 4):
        for max_new in (1, 9, 30):
            spec = speculative_generate(runner, Eagle3Drafter(head, 128), prompt, max_new, set(), k=k)
            assert spec.tokens == greedy_generate(runner, prompt, max_new, set()).tokens


def test_committed_demo_head_is_accepted_by_the_demo_target():
    target = Target.from_pretrained(TargetConfig(path=str(REPO / "configs/demo/target"), dtype="float32"))
    tokenizer = load_tokenizer(str(REPO / "configs/demo/target"))
    head = Eagle3Draft.from_pretrained(REPO / "configs/demo/eagle3-head", target_embeddings=target.embed_tokens.weight)
    runner = TargetRunner(target, max_len=512)
    eos = {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    rows = [json.loads(line) for line in (REPO / "configs/demo/data/gsm8k_train.jsonl").read_text().splitlines()[:3]]
    produced = forwards = 0
    for row in rows:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": row["question"]}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)["input_ids"]
        plain = greedy_generate(runner, prompt, 64, eos)
        spec = speculative_generate(runner, Eagle3Drafter(head, 512), prompt, 64, eos, k=4)
        assert spec.tokens == plain.tokens
        produced += len(spec.tokens) - 1
        forwards += spec.target_forwards
    tau = produced / forwards
    assert tau > 1.8, f"tau {tau:.2f}: the head is not drafting what the target says"


@pytest.mark.parametrize("num_layers", [1, 3])
def test_drafter_steps_reproduce_the_ttt_logits_position_by_position(num_layers):
    """Driven with the true tokens, inference step i at position t computes exactly what TTT step i
    computes at t: same rotary positions, same keys attended -- in every layer of a multi-layer draft."""
    from headstart.models.head import Features

    model = tiny_causal_lm("llama", num_hidden_layers=8)
    target = Target(model)
    torch.manual_seed(0)
    head = Eagle3Draft(Eagle3Config.from_target(model.config, draft_vocab_size=48, num_layers=num_layers), ttt_steps=4)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.2)
    head.set_draft_vocab(*build_draft_vocab(torch.randint(0, 9, (128,)), 48))
    head.load_target_embeddings(target.embed_tokens.weight)
    ids = torch.randint(3, 128, (1, 14), generator=torch.Generator().manual_seed(6))
    out = target(ids)
    aux = out.aux_hidden_states
    features = Features(input_ids=ids, loss_mask=torch.ones_like(ids), aux_hidden_states=aux,
                        target_logits=torch.zeros(1, 14, 48), target_in_draft=torch.ones(1, 14, dtype=torch.bool))
    with torch.no_grad():
        ttt = list(head.unroll(features))  # 4 x [1, 14, 48]
    for t in (3, 6, 9):
        drafter = Eagle3Drafter(head, 64)
        drafter.begin(ids[:, : t + 1], out.select(slice(0, t + 1)), int(ids[0, t + 1]))
        torch.testing.assert_close(drafter.last_logits[0], ttt[0][0, t], rtol=1e-4, atol=1e-4)
        hidden = drafter.last_hidden
        for i in range(1, 4):
            hidden = drafter._step(hidden, ids[:, t + 1 + i].view(1, 1), drafter.length - 1 + i)
            torch.testing.assert_close(drafter._logits(hidden)[0, -1], ttt[i][0, t], rtol=1e-4, atol=1e-4)
