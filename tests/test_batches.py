"""Batches are a pure function of (seed, global step, global batch): the basis of exact resume,
on the world size that wrote a checkpoint or another."""

from __future__ import annotations

import datasets

from headstart.trainer.batches import BatchPlan, collate, split_eval


def plans(world_size: int, batch_size: int, grad_accum: int, seed: int = 3, num_rows: int = 10) -> list[BatchPlan]:
    return [BatchPlan(num_rows, batch_size, world_size, r, grad_accum, seed) for r in range(world_size)]


def step_rows(ranks: list[BatchPlan], step: int, grad_accum: int) -> list[int]:
    return [i for p in ranks for m in range(grad_accum) for i in p.rows(step, m)]


def test_ranks_partition_each_global_batch_and_epochs_cover_all_rows():
    ranks = plans(world_size=2, batch_size=2, grad_accum=1)
    seen = []
    for g in range(5):  # 5 global batches x 4 rows = 2 epochs of 10 rows
        a, b = ranks[0].rows(g, 0), ranks[1].rows(g, 0)
        if g != 2:  # global batch 2 (stream rows 8..11) straddles the epoch boundary
            assert not set(a) & set(b)
        seen += a + b
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    assert seen[:10] != seen[10:]  # a new order each epoch
    again = plans(world_size=2, batch_size=2, grad_accum=1)[1]
    assert [again.rows(g, 0) for g in range(5)] == [ranks[1].rows(g, 0) for g in range(5)]
    other_seed = plans(world_size=2, batch_size=2, grad_accum=1, seed=4)[1]
    assert [other_seed.rows(g, 0) for g in range(5)] != [ranks[1].rows(g, 0) for g in range(5)]
    assert ranks[0].epoch_of(5) == 2.0


def test_a_step_trains_on_the_same_rows_however_the_global_batch_is_split():
    # Global batch 8 as 2 ranks x 2 rows x 2 micro-batches, 1 rank x 4 x 2, 4 ranks x 2 x 1, 1 x 1 x 8.
    splits = [(2, 2, 2), (1, 4, 2), (4, 2, 1), (1, 1, 8)]
    reference = [sorted(step_rows(plans(2, 2, 2, num_rows=13), s, 2)) for s in range(6)]
    for world, batch, accum in splits:
        assert [sorted(step_rows(plans(world, batch, accum, num_rows=13), s, accum)) for s in range(6)] == reference


def test_resuming_with_another_global_batch_continues_at_the_first_unseen_row():
    before = plans(world_size=2, batch_size=2, grad_accum=1, num_rows=50)  # G = 4
    seen = [i for s in range(3) for i in step_rows(before, s, 1)]  # 12 rows
    after = plans(world_size=1, batch_size=3, grad_accum=1, num_rows=50)  # G = 3
    after[0].resume_at(step=3, rows_seen=before[0].rows_seen(3))
    seen += [i for s in range(3, 7) for i in step_rows(after, s, 1)]  # 12 more
    one_run = plans(world_size=1, batch_size=24, grad_accum=1, num_rows=50)
    assert seen == one_run[0].rows(0, 0)  # the stream's first 24 rows, none repeated or skipped
    assert after[0].rows_seen(7) == 24


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
