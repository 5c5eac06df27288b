"""Batches are a pure function of (seed, global step, global batch): the basis of exact resume,
on the world size that wrote a checkpoint or another."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
import torch

from headstart.trainer.batches import BatchPlan, RowWork, collate, row_work, split_eval


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


def costed_plans(world_size: int, batch_size: int, grad_accum: int, tokens: list[int], trained: list[int] | None = None,
                 seed: int = 3, max_tokens: int | None = None) -> list[BatchPlan]:
    work = RowWork(np.array(tokens), np.array(trained if trained is not None else [t // 2 + 1 for t in tokens]))
    return [BatchPlan(len(tokens), batch_size, world_size, r, grad_accum, seed, work=work, max_tokens=max_tokens)
            for r in range(world_size)]


def test_dealing_by_work_keeps_each_steps_rows_and_levels_the_micro_batches():
    """With row work a step trains on exactly the rows it trains on without it, however G is split; every rank
    computes the same dealing (their micro-batches partition the step's rows, none empty); and the busiest
    micro-batch carries less than with consecutive rows, within one row of the mean (LPT's guarantee)."""
    g = torch.Generator().manual_seed(0)
    tokens = (torch.rand(40, generator=g) ** 4 * 500 + 20).long().tolist()  # a long tail, like chat data's lengths
    trained = [t // 2 + 1 for t in tokens]
    cost = [t + n for t, n in zip(tokens, trained)]
    for world, batch, accum in [(2, 4, 1), (4, 2, 1), (2, 2, 2), (1, 4, 2)]:
        plain, dealt = plans(world, batch, accum, num_rows=40), costed_plans(world, batch, accum, tokens, trained)
        worst_plain, worst_dealt = [], []
        for step in range(12):  # 12 steps x 8 rows: two epochs and a bit, one step straddling an epoch's end
            bins = [p.rows(step, m) for p in dealt for m in range(accum)]
            assert sorted(i for b in bins for i in b) == sorted(step_rows(plain, step, accum))
            assert all(bins)
            work = [sum(cost[i] for i in b) for b in bins]
            mean = sum(work) / len(work)
            assert max(work) <= mean + max(cost[i] for b in bins for i in b)
            worst_dealt.append(max(work) / mean)
            worst_plain.append(max(sum(cost[i] for i in p.rows(step, m)) for p in plain for m in range(accum)) / mean)
        if world * accum > 1:
            assert sum(worst_dealt) < 0.9 * sum(worst_plain)
        again = costed_plans(world, batch, accum, tokens, trained)
        assert [p.rows(5, 0) for p in again] == [p.rows(5, 0) for p in dealt]


def test_dealing_never_puts_more_tokens_in_a_micro_batch_than_b_rows_can_hold():
    """Two micro-batches of B=2 rows of at most 10 tokens: 20 tokens each at most. By work alone the 6-token rows
    would join the 10-token row of little work (22 tokens); capped, one goes to the other micro-batch. And where
    no dealing fits (one row too long for what is left anywhere), the step keeps consecutive rows."""
    tokens, trained = [10, 10, 6, 6], [10, 1, 1, 1]  # costs 20, 11, 7, 7; every step holds all four rows
    uncapped, capped = costed_plans(2, 2, 1, tokens, trained), costed_plans(2, 2, 1, tokens, trained, max_tokens=20)
    assert max(sum(tokens[i] for i in p.rows(0, 0)) for p in uncapped) == 22  # the case under test
    for step in range(4):
        assert all(sum(tokens[i] for i in p.rows(step, 0)) <= 20 for p in capped)
        assert sorted(i for p in capped for i in p.rows(step, 0)) == [0, 1, 2, 3]
    stuck = costed_plans(2, 2, 1, [10, 10, 10, 1], [1, 9, 5, 1], max_tokens=15)  # 3 rows of 10 in 2 bins of 15
    assert [p.rows(1, 0) for p in stuck] == [p.rows(1, 0) for p in plans(2, 2, 1, num_rows=4)]


def test_dealing_by_work_resumes_and_reshards_like_the_stream():
    """Dealt plans still address a step by (seed, step, G): a run resumed at step 3 on another world size with the
    same G trains on the rows of an uninterrupted run."""
    tokens = [10 + (7 * i) % 23 for i in range(30)]
    one_run = costed_plans(2, 3, 1, tokens)
    resumed = costed_plans(3, 2, 1, tokens)
    for p in resumed:
        p.resume_at(step=3, rows_seen=0)
        p.rows(3, 0)  # step 3 dealt from other rows and cached: a later resume must not be served it
        p.resume_at(step=3, rows_seen=one_run[0].rows_seen(3))
    for step in range(3, 9):
        assert sorted(step_rows(resumed, step, 1)) == sorted(step_rows(one_run, step, 1))


def test_row_work_reads_tokens_and_trained_tokens_of_the_selected_rows():
    import pyarrow as pa

    ds = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7], [8], [1, 2, 3, 4, 5]],
                                     "loss_mask": [[0, 1, 1], [1], [0, 0, 0, 1, 1]], "other": ["a", "b", "c"]})
    work = row_work(ds)
    assert work.tokens.tolist() == [3, 1, 5] and work.trained.tolist() == [2, 1, 2]
    picked = row_work(ds.select([2, 0]))  # an indices mapping (split_eval) is followed
    assert picked.tokens.tolist() == [5, 3] and picked.trained.tolist() == [2, 2]
    chunked = datasets.Dataset(pa.concat_tables([ds.data.table.slice(0, 2), ds.data.table.slice(2, 1)]))
    assert row_work(chunked).trained.tolist() == [2, 1, 2]  # a table of several chunks
    with pytest.raises(ValueError, match="row work for 2 rows, the data has 3"):
        BatchPlan(3, 1, 1, 0, 1, 0, work=RowWork(np.array([1, 2]), np.array([1, 1])))
