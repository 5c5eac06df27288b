"""The chain loop every sequential drafter shares (decode/chain.py): what a drafter's step gives it, it drafts in order,
stops where the room or the confidence rule says, and returns q on the target's vocab."""

from __future__ import annotations

import torch

from headstart.decode.chain import ChainDrafter, ChainRows
from headstart.decode.verify import Sampling


class Table(ChainDrafter):
    """Draft i's logits are row i of a table [K, V'] plus a bonus for the id after draft i-1's target id, so the chain
    depends on what was drafted before; a truncated draft vocab maps draft id j to target id ``ids[j]``."""

    def __init__(self, table: torch.Tensor, room: int, ids: torch.Tensor | None = None, target_vocab: int = 0) -> None:
        self.table, self.room, self.ids = table, room, ids
        self.device, self.target_vocab_size = table.device, target_vocab or table.shape[1]
        self.seen: list[int | None] = []

    def chain_room(self, k: int) -> int:
        self.seen = []
        return min(k, self.room)

    def chain_logits(self, i: int, previous: torch.Tensor | None) -> torch.Tensor:
        self.seen.append(None if previous is None else int(previous))
        return self.table[i]

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.ids is None else self.ids[ids]

    def draft_vocab(self) -> torch.Tensor | None:
        return self.ids


def test_a_greedy_chain_feeds_each_draft_to_the_next_step_within_its_room():
    table = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0], [1.0, 0.0, 0.0]])
    drafter = Table(table, room=3, ids=torch.tensor([2, 5, 7]), target_vocab=8)
    assert drafter.propose(4).tolist() == [5, 2, 7]  # argmax 1, 0, 2 of the first three rows, as target ids
    assert drafter.seen == [None, 5, 2]  # each step got the previous draft as a target id
    assert drafter.propose(0).tolist() == [] and drafter.seen == []


def test_the_confidence_rule_stops_after_the_first_unsure_draft():
    table = torch.tensor([[9.0, 0.0, 0.0], [0.0, 0.1, 0.0], [0.0, 0.0, 9.0]])
    drafter = Table(table, room=3)
    drafter.confidence_threshold = 0.5
    assert drafter.propose(3).tolist() == [0, 1]  # the unsure second draft is kept, the third step never runs
    assert len(drafter.seen) == 2


def test_sampled_q_lies_on_the_target_vocab_zero_outside_the_draft_vocab():
    table = torch.tensor([[0.0, 2.0, 1.0], [1.0, 1.0, 1.0]])
    ids = torch.tensor([1, 4, 6])
    drafter = Table(table, room=2, ids=ids, target_vocab=8)
    tokens, q = drafter.propose_sampled(2, Sampling(1.0), torch.Generator().manual_seed(0))
    assert q.shape == (2, 8) and tokens.shape == (2,)
    torch.testing.assert_close(q[:, ids], torch.softmax(table, -1))
    assert q[:, [0, 2, 3, 5, 7]].sum() == 0
    assert all(int(t) in ids.tolist() for t in tokens)
    _, none = drafter.propose_sampled(0, Sampling(1.0))
    assert none.shape == (0, 8)


class Rows(ChainRows):
    """Every row drafts from the same table as ``Table``, in one call a step, with row b's logits shifted by b."""

    def __init__(self, table: torch.Tensor, rows: int, ids: torch.Tensor, target_vocab: int) -> None:
        self.table, self.rows, self.ids = table, rows, ids
        self.device, self.target_vocab_size = table.device, target_vocab

    def chain_rows(self, steps: int, pick) -> torch.Tensor:
        picked = [self.ids[pick(torch.stack([self.table[i].roll(b) for b in range(self.rows)]))]
                  for i in range(steps)]
        return torch.stack(picked, 1) if picked else torch.empty(self.rows, 0, dtype=torch.long)

    def draft_vocab(self) -> torch.Tensor | None:
        return self.ids


def test_batch_chains_cut_each_row_to_its_budget_and_give_q_on_the_target_vocab():
    table = torch.tensor([[0.0, 9.0, 1.0], [9.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    ids = torch.tensor([1, 4, 6])
    drafter = Rows(table, rows=2, ids=ids, target_vocab=8)
    greedy = drafter.propose_batch([3, 1])
    assert [g.tolist() for g in greedy] == [[4, 1, 6], [6]]  # row 1's logits rolled by one: argmax 2 -> id 6
    tokens, q = drafter.propose_sampled_batch([2, 0], Sampling(1.0), torch.Generator().manual_seed(0))
    assert [len(t) for t in tokens] == [2, 0] and q[0].shape == (2, 8) and q[1].shape == (0, 8)
    torch.testing.assert_close(q[0][:, ids], torch.softmax(table[:2], -1))
    assert q[0][:, [0, 2, 3, 5, 7]].sum() == 0
