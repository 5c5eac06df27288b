"""Replayed speculative decoding (decode/replay.py) accepts exactly what a real run accepts, round by round."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from headstart.decode.generate import speculative_generate
from headstart.decode.ngram import NgramDrafter
from headstart.decode.replay import ReplayRunner, Turn, record_turn
from headstart.decode.target_runner import TargetRunner
from headstart.decode.tree import DynamicTree
from headstart.heads.registry import drafter_for, load_head
from headstart.models.target import Target, TargetConfig, TargetOutput, load_tokenizer

REPO = Path(__file__).resolve().parents[1]


def _turn(sequence: list[int], prompt_len: int, hidden: int = 4) -> Turn:
    """A recorded turn whose state at position p is the vector filled with p (so a test can read positions back)."""
    n = len(sequence)
    last = torch.arange(n, dtype=torch.float32)[None, :, None].expand(1, n, hidden)
    return Turn(torch.tensor([sequence[:prompt_len]]), sequence[prompt_len:], TargetOutput(None, last.clone()))


def test_a_node_is_on_the_targets_path_only_with_all_its_ancestors():
    runner = ReplayRunner(_turn([5, 6, 7, 8, 9, 10, 11], prompt_len=2), vocab_size=16)
    logits, states = runner.forward(torch.tensor([[5, 6]]))
    assert logits[0].argmax(-1).tolist() == [6, 7]  # the prompt's last position picks the first output token
    runner.commit(2)
    # block [root 7, a=3 (wrong, depth 1), b=9 (a's child, depth 2: the recorded token there), c=8 (root's child)]
    parents_mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    logits, states = runner.forward(torch.tensor([[7, 3, 9, 8]]), tree_mask=parents_mask, depths=torch.tensor([0, 1, 2, 1]))
    choice = logits[0].argmax(-1).tolist()
    assert choice[0] == 8 and choice[3] == 9  # on the path: the recorded next tokens
    assert choice[1] == 0 and choice[2] == 0  # b matches its position but hangs below a wrong token: off the path
    assert states.last_hidden_state[0, :, 0].tolist() == [2, 3, 4, 3]  # each token's state at its own position
    assert runner.blocks == [(4, True)]
    runner.keep([0, 3])
    assert runner.moves == [1]  # node 3 moves to the slot after the root; a path [0, 1, ...] would stay in place
    logits, _ = runner.forward(torch.tensor([[9, 10, 11]]))  # a chain; its last token's next runs past the output
    assert logits[0].argmax(-1).tolist() == [10, 11, 0] and runner.blocks[-1] == (3, False)
    logits, _ = runner.forward(torch.tensor([[9, 4, 11]]))
    assert logits[0].argmax(-1).tolist() == [10, 0, 0]  # a chain leaves the path at its first wrong token


@pytest.fixture(scope="module")
def demo():
    target = Target.from_pretrained(TargetConfig(path=str(REPO / "configs/demo/target"), dtype="float32"))
    tokenizer = load_tokenizer(str(REPO / "configs/demo/target"))
    head = load_head("eagle3", str(REPO / "configs/demo/eagle3-head"), target, allow_other_target=True)
    rows = [json.loads(line) for line in (REPO / "configs/demo/data/gsm8k_train.jsonl").read_text().splitlines()[:2]]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": r["question"]}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)["input_ids"] for r in rows]
    eos = {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    return target, head, prompts, eos


@pytest.mark.parametrize("shape", [pytest.param("chain", marks=pytest.mark.nightly), "tree",
                                   pytest.param("ngram", marks=pytest.mark.nightly)])  # a tree exercises the most
def test_replay_accepts_what_the_real_run_accepts_round_by_round(demo, shape):
    target, head, prompts, eos = demo
    runner = TargetRunner(target, max_len=512)
    vocab = target.lm_head.weight.shape[0]
    tree = DynamicTree(depth=4, topk=3, total_tokens=10) if shape == "tree" else None
    make = (lambda: NgramDrafter()) if shape == "ngram" else (lambda: drafter_for(head, 512))
    accepted = 0
    for prompt in prompts:
        real = speculative_generate(runner, make(), prompt, 40, eos, k=4, tree=tree)
        turn = record_turn(runner, prompt, 40, eos)
        assert turn.output == real.tokens
        replay_runner = ReplayRunner(turn, vocab)
        replayed = speculative_generate(replay_runner, make(), prompt, 40, eos, k=4, tree=tree)
        assert replayed.tokens == real.tokens
        assert replayed.proposed == real.proposed
        # the same acceptance in every round; past an EOS the replay accepts nothing (decode/replay.py)
        assert replayed.accepted[:-1] == real.accepted[:-1] and replayed.accepted[-1] <= real.accepted[-1]
        assert replayed.accepted[-1] == real.accepted[-1] or real.tokens[-1] in eos
        assert len(replay_runner.blocks) == real.target_forwards
        assert all(masked == (tree is not None) for _, masked in replay_runner.blocks)
        accepted += sum(real.accepted)
    assert accepted > 10  # the comparison covered accepted drafts, not only rejections
