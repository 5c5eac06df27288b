"""Deterministic, rank-sharded micro-batches addressed by their global index.

Row order is a fixed function of (seed, epoch), and micro-batch ``g`` takes rows
``[g*W*B, (g+1)*W*B)`` of that endless stream (rank r its own slice of B). A run resumed at step s
therefore sees exactly the batches an uninterrupted run would, with no loader state to save.
"""

from __future__ import annotations

import datasets
import torch


class BatchPlan:
    def __init__(self, num_rows: int, batch_size: int, world_size: int, rank: int, seed: int) -> None:
        if num_rows < 1:
            raise ValueError("no training rows")
        self.num_rows, self.batch_size, self.world_size, self.rank, self.seed = num_rows, batch_size, world_size, rank, seed
        self._orders: dict[int, list[int]] = {}  # the current and the next epoch's order

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            if len(self._orders) >= 2:
                self._orders.pop(min(self._orders))
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._orders[epoch] = torch.randperm(self.num_rows, generator=g).tolist()
        return self._orders[epoch]

    def rows(self, micro_batch: int) -> list[int]:
        """Row indices of this rank's share of global micro-batch ``micro_batch``."""
        start = (micro_batch * self.world_size + self.rank) * self.batch_size
        return [self._order(p // self.num_rows)[p % self.num_rows] for p in range(start, start + self.batch_size)]

    def epoch_of(self, micro_batch: int) -> float:
        return micro_batch * self.world_size * self.batch_size / self.num_rows


def collate(dataset: datasets.Dataset, rows: list[int]) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids, loss_mask, attention_mask, each [B, T_max]."""
    items = dataset[rows]
    T = max(len(x) for x in items["input_ids"])
    B = len(rows)
    input_ids = torch.zeros(B, T, dtype=torch.long)
    loss_mask = torch.zeros(B, T, dtype=torch.long)
    attention_mask = torch.zeros(B, T, dtype=torch.long)
    for i, (ids, mask) in enumerate(zip(items["input_ids"], items["loss_mask"])):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        loss_mask[i, : len(ids)] = torch.tensor(mask)
        attention_mask[i, : len(ids)] = 1
    batch = {"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": attention_mask}
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
