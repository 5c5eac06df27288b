"""Deterministic, rank-sharded micro-batches addressed by the global step.

Row order is a fixed function of (seed, epoch): an endless stream. Global step s takes the next
G = batch_size x world_size x grad_accum rows of it, and deals them to the W x grad_accum micro-batches
(micro-batch m of rank r is number m x W + r): by each row's work when the plan has it (packed batches: longest
first, each to the micro-batch with the least work so far and room for it, so ranks finish a micro-batch together
instead of waiting at each collective for the one that drew the long conversations), else B consecutive rows each.
The loss is the global batch's token mean either way (``models.head.loss_denominator``), so the dealing changes no
step's mathematics.
Which rows a step trains on depends only on the step and the global batch G, not on how G is split over ranks
and micro-batches: a run resumed on another world size with the same G sees exactly the samples of an
uninterrupted run, and with another G it continues from the first row not yet seen. No loader state to save but
``rows_seen``.
"""

from __future__ import annotations

from dataclasses import dataclass

import datasets
import numpy as np
import pyarrow.compute as pc
import torch


@dataclass(frozen=True)
class RowWork:
    """What a step's rows are dealt by: each row's tokens (the target's forward, a draft's first step) and trained
    tokens (EAGLE-3's later TTT steps, every head's vocab loss and the teacher run only there), [num_rows] each."""

    tokens: np.ndarray
    trained: np.ndarray

    def __len__(self) -> int:
        return len(self.tokens)


def row_work(dataset: datasets.Dataset) -> RowWork:
    """``RowWork`` of every row, from the Arrow columns chunk by chunk (not as Python lists: 0.3 s for 21k rows)."""
    columns = dataset.select_columns(["input_ids", "loss_mask"]).with_format("arrow")[:]
    tokens, trained = [], []
    for ids, mask in zip(columns["input_ids"].chunks, columns["loss_mask"].chunks):
        tokens.append(pc.list_value_length(ids).to_numpy(zero_copy_only=False))
        trained.append(np.bincount(pc.list_parent_indices(mask).to_numpy(), minlength=len(mask),
                                   weights=pc.list_flatten(mask).to_numpy(zero_copy_only=False)))
    return RowWork(np.concatenate(tokens).astype(np.int64), np.concatenate(trained).astype(np.int64))


class BatchPlan:
    def __init__(self, num_rows: int, batch_size: int, world_size: int, rank: int, grad_accum: int, seed: int,
                 work: RowWork | None = None, max_tokens: int | None = None) -> None:
        """``work``: each row's size (``row_work``); given, a step's rows are dealt to micro-batches by it, none
        holding more than ``max_tokens`` tokens (what ``batch_size`` consecutive rows can hold: batch_size x
        max_length), so dealing never makes a micro-batch larger than the recipe allows for."""
        if num_rows < 1:
            raise ValueError("no training rows")
        if work is not None and len(work) != num_rows:
            raise ValueError(f"row work for {len(work)} rows, the data has {num_rows}")
        self.num_rows, self.batch_size, self.world_size, self.rank, self.seed = num_rows, batch_size, world_size, rank, seed
        self.grad_accum, self.work, self.max_tokens = grad_accum, work, max_tokens
        self.global_batch = batch_size * world_size * grad_accum
        self._first_step, self._first_row = 0, 0  # where this plan joins the stream (moved by resume_at)
        self._orders: dict[int, list[int]] = {}  # the current and the next epoch's order
        self._dealt: tuple[int, list[list[int]]] | None = None  # (step, its micro-batches): rows() asks once per micro

    def resume_at(self, step: int, rows_seen: int) -> None:
        """Continue at ``step`` with the stream's first ``rows_seen`` rows already trained on."""
        self._first_step, self._first_row = step, rows_seen
        self._dealt = None

    def rows_seen(self, step: int) -> int:
        """Rows of the stream trained on before global step ``step``."""
        return self._first_row + (step - self._first_step) * self.global_batch

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            if len(self._orders) >= 2:
                self._orders.pop(min(self._orders))
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._orders[epoch] = torch.randperm(self.num_rows, generator=g).tolist()
        return self._orders[epoch]

    def _stream(self, start: int, count: int) -> list[int]:
        return [self._order(p // self.num_rows)[p % self.num_rows] for p in range(start, start + count)]

    def rows(self, step: int, micro: int) -> list[int]:
        """Row indices of this rank's micro-batch ``micro`` of global step ``step``."""
        index = micro * self.world_size + self.rank
        if self.work is not None:
            if self._dealt is None or self._dealt[0] != step:
                self._dealt = step, self._deal(self._stream(self.rows_seen(step), self.global_batch))
            if self._dealt[1] is not None:
                return self._dealt[1][index]
        return self._stream(self.rows_seen(step) + index * self.batch_size, self.batch_size)

    def _deal(self, rows: list[int]) -> list[list[int]] | None:
        """Longest-processing-time-first: the costliest row (tokens + trained tokens) first, each to the micro-batch
        with the least work so far (ties: the lower number) among those it fits in (``max_tokens``); each
        micro-batch then keeps its rows in stream order. None when some row fits nowhere (rows near max_length
        throughout): the step keeps B consecutive rows per micro-batch. Every micro-batch gets at least one row
        (G >= their number, and every row costs > 0)."""
        n = self.world_size * self.grad_accum
        tokens, cost = self.work.tokens, self.work.tokens + self.work.trained
        work, used, dealt = [0] * n, [0] * n, [[] for _ in range(n)]
        for position in sorted(range(len(rows)), key=lambda i: (-int(cost[rows[i]]), i)):
            row = rows[position]
            fits = [b for b in range(n) if self.max_tokens is None or used[b] + tokens[row] <= self.max_tokens]
            if not fits:
                return None
            target = min(fits, key=lambda b: (work[b], b))
            work[target] += int(cost[row])
            used[target] += int(tokens[row])
            dealt[target].append(position)
        return [[rows[i] for i in sorted(positions)] for positions in dealt]

    def epoch_of(self, step: int) -> float:
        """Epochs completed once ``step`` steps are done."""
        return self.rows_seen(step) / self.num_rows


def pack(lengths: list[int], capacity: int) -> list[tuple[int, int]]:
    """First-fit decreasing: (bin, start) of each sequence, bins holding at most ``capacity`` tokens (a longer
    sequence gets a bin of its own). Longest first, ties in the given order, so the packing is deterministic."""
    placement: list[tuple[int, int]] = [(0, 0)] * len(lengths)
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        b = next((b for b, u in enumerate(used) if u + lengths[i] <= capacity), len(used))
        if b == len(used):
            used.append(0)
        placement[i] = (b, used[b])
        used[b] += lengths[i]
    return placement


def collate(dataset: datasets.Dataset, rows: list[int], pack_tokens: int | None = None) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids, loss_mask, attention_mask, each [B, T_max], one sequence per row.

    ``pack_tokens``: the sequences packed (``pack``) into rows of at most that many tokens, padded to the
    longest: [n_rows, T], plus ``position_ids`` restarting at 0 for each sequence (and for the padding at a
    row's end, which attends only to itself), from which the target's and the heads' attention keep every
    sequence to itself (models/head.py). ``segments`` [n, 3] says where each of the ``rows`` sits: (batch row,
    start, length)."""
    items = dataset[rows]
    lengths = [len(x) for x in items["input_ids"]]
    placement = [(i, 0) for i in range(len(rows))] if pack_tokens is None else pack(lengths, pack_tokens)
    B = max(b for b, _ in placement) + 1
    T = max(start + n for (_, start), n in zip(placement, lengths))
    input_ids = torch.zeros(B, T, dtype=torch.long)
    loss_mask = torch.zeros(B, T, dtype=torch.long)
    attention_mask = torch.zeros(B, T, dtype=torch.long)
    for (b, start), ids, mask in zip(placement, items["input_ids"], items["loss_mask"]):
        input_ids[b, start : start + len(ids)] = torch.tensor(ids)
        loss_mask[b, start : start + len(ids)] = torch.tensor(mask)
        attention_mask[b, start : start + len(ids)] = 1
    batch = {"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": attention_mask,
             "segments": torch.tensor([(b, start, n) for (b, start), n in zip(placement, lengths)])}
    if pack_tokens is not None:
        position_ids = torch.zeros(B, T, dtype=torch.long)
        for (b, start), n in zip(placement, lengths):
            position_ids[b, start : start + n] = torch.arange(n)
        for b in range(B):
            used = int(attention_mask[b].sum())
            position_ids[b, used:] = torch.arange(T - used)
        batch["position_ids"] = position_ids
    if "row" in items:  # the dataset row each sequence came from (offline features are keyed by it)
        batch["row"] = torch.tensor(items["row"])
    return batch


def split_eval(dataset: datasets.Dataset, fraction: float, seed: int) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """Hold out ``fraction`` of the rows (at least one when fraction > 0) for evaluation."""
    if fraction <= 0 or len(dataset) < 2:
        return dataset, None
    n_eval = max(1, int(len(dataset) * fraction))
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()
    return dataset.select(sorted(order[n_eval:])), dataset.select(sorted(order[:n_eval]))
