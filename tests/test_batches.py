"""Batches are a pure function of (seed, micro-batch index): the basis of exact resume."""

from __future__ import annotations

import datasets

from headstart.trainer.batches import BatchPlan, collate, split_eval


def test_ranks_partition_each_global_batch_and_epochs_cover_all_rows():
    ranks = [BatchPlan(10, batch_size=2, world_size=2, rank=r, seed=3) for r in range(2)]
    seen = []
    for g in range(5):  # 5 global batches x 4 rows = 2 epochs of 10 rows
        a, b = ranks[0].rows(g), ranks[1].rows(g)
        if g != 2:  # global batch 2 (stream rows 8..11) straddles the epoch boundary
            assert not set(a) & set(b)
        seen += a + b
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    assert seen[:10] != seen[10:]  # a new order each epoch
    again = BatchPlan(10, batch_size=2, world_size=2, rank=1, seed=3)
    assert [again.rows(g) for g in range(5)] == [ranks[1].rows(g) for g in range(5)]
    other_seed = BatchPlan(10, batch_size=2, world_size=2, rank=1, seed=4)
    assert [other_seed.rows(g) for g in range(5)] != [ranks[1].rows(g) for g in range(5)]


def test_collate_right_pads_and_split_eval_is_disjoint():
    ds = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7], [8]], "loss_mask": [[0, 1, 1], [1]]})
    batch = collate(ds, [0, 1])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    big = datasets.Dataset.from_dict({"input_ids": [[i] for i in range(100)], "loss_mask": [[1]] * 100})
    train, held = split_eval(big, 0.05, seed=0)
    assert len(held) == 5 and len(train) == 95
    assert not {r[0] for r in train["input_ids"]} & {r[0] for r in held["input_ids"]}
