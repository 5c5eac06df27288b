"""The one training loop, for every head and both backends.

    train() -> train_step() -> forward_backward()      (torchtitan's shape)

A step: ``grad_accum`` micro-batches, each: online target features -> ``head.loss`` -> backward;
then clip + optimizer step. Metrics are reduced across ranks with one all-reduce per step.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Callable

import datasets
import torch
from tqdm import tqdm

from headstart.models.head import Features
from headstart.trainer.batches import BatchPlan, collate
from headstart.trainer.checkpoint import latest_checkpoint, save_checkpoint
from headstart.trainer.config import RunConfig
from headstart.trainer.distributed import DistInfo, all_reduce_sum
from headstart.trainer.metrics import MetricsLogger


def autocast_context(mixed_precision: str, device: torch.device):
    use_bf16 = mixed_precision == "bf16" or (mixed_precision == "auto" and device.type == "cuda")
    if mixed_precision not in ("auto", "bf16", "fp32"):
        raise ValueError(f"train.mixed_precision must be auto, bf16 or fp32, got {mixed_precision!r}")
    return torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()


class Trainer:
    def __init__(
        self,
        config: RunConfig,
        info: DistInfo,
        backend,
        features: Callable[[dict[str, torch.Tensor]], Features],
        train_data: datasets.Dataset,
        eval_data: datasets.Dataset | None,
        export_draft: Callable[[dict[str, torch.Tensor], Path], None],
        logger: MetricsLogger,
        decode_eval: Callable[[dict[str, torch.Tensor] | None], dict[str, float] | None] | None = None,
    ) -> None:
        self.config, self.info, self.backend, self.features = config, info, backend, features
        self.decode_eval = decode_eval
        self.train_data, self.eval_data, self.export_draft_fn, self.logger = train_data, eval_data, export_draft, logger
        t = config.train
        self.plan = BatchPlan(len(train_data), t.batch_size, info.world_size, info.rank, t.seed)
        self.step = 0
        self.tokens_seen = 0

    # -- checkpoints ----------------------------------------------------------------------------
    def export_draft(self, directory: Path) -> None:
        state = self.backend.full_state_dict()  # collective
        if self.info.is_main:
            self.export_draft_fn(state, directory)

    def save(self) -> Path:
        return save_checkpoint(
            self.config.output_dir, self.step, self.info, self.backend.save, self.export_draft,
            {"step": self.step, "tokens_seen": self.tokens_seen, "world_size": self.info.world_size},
            keep=self.config.train.keep_checkpoints,
        )

    def resume(self) -> bool:
        path = latest_checkpoint(self.config.output_dir)
        if path is None:
            return False
        state = json.loads((path / "trainer_state.json").read_text())
        if state["world_size"] != self.info.world_size:
            raise ValueError(f"{path} was written by {state['world_size']} ranks; resume it with the same world size "
                             f"(now {self.info.world_size}) so the batches continue exactly")
        self.backend.load(path / "state")
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        if self.info.is_main:  # drop metrics logged after that checkpoint by the interrupted run
            lines = self.logger.path.read_text().splitlines() if self.logger.path.exists() else []
            kept = [line for line in lines if json.loads(line)["step"] <= self.step]
            self.logger.path.write_text("".join(line + "\n" for line in kept))
        return True

    # -- training -------------------------------------------------------------------------------
    def forward_backward(self, batch: dict[str, torch.Tensor], last_micro: bool) -> dict[str, float]:
        features = self.features(batch)
        with autocast_context(self.config.train.mixed_precision, self.info.device):
            loss, metrics = self.backend.forward(features)
        self.backend.backward(loss, last_micro)
        return {"loss": float(loss.detach()), **metrics, "tokens": float(batch["attention_mask"].sum())}

    def train_step(self) -> dict[str, float]:
        accum = self.config.train.grad_accum
        micro_metrics = []
        for micro in range(accum):
            rows = self.plan.rows(self.step * accum + micro)
            micro_metrics.append(self.forward_backward(collate(self.train_data, rows), micro == accum - 1))
        grad_norm = self.backend.step()
        metrics = self._reduce(micro_metrics)
        metrics.update(grad_norm=grad_norm, lr=self.backend.lr, epoch=self.plan.epoch_of((self.step + 1) * accum))
        return metrics

    def _reduce(self, records: list[dict[str, float]]) -> dict[str, float]:
        """Mean over micro-batches and ranks; token counts are summed."""
        keys = sorted(records[0])
        local = torch.tensor([[r[k] for k in keys] for r in records], dtype=torch.float64).sum(0)
        total = all_reduce_sum(local.to(self.info.device)).cpu()
        n = len(records) * self.info.world_size
        return {k: (v if k in ("tokens", "valid_tokens") else v / n) for k, v in zip(keys, total.tolist())}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float] | None:
        if self.eval_data is None:
            return None
        t = self.config.train
        per_batch = t.batch_size * self.info.world_size
        # The same number of batches on every rank: FSDP's forward is collective.
        n_batches = min(t.max_eval_batches, -(-len(self.eval_data) // per_batch))
        records = []
        for b in range(n_batches):
            start = (b * self.info.world_size + self.info.rank) * t.batch_size
            rows = [(start + i) % len(self.eval_data) for i in range(t.batch_size)]
            features = self.features(collate(self.eval_data, rows))
            with autocast_context(t.mixed_precision, self.info.device):
                loss, metrics = self.backend.forward(features)
            records.append({"loss": float(loss), **metrics})
        return self._reduce(records)

    def train(self, resume: bool = False) -> dict[str, float] | None:
        t = self.config.train
        if resume and self.resume() and self.info.is_main:
            print(f"resumed from step {self.step}")
        bar = tqdm(total=t.max_steps, initial=self.step, desc="train", disable=not (self.info.is_main and self.config.logging.progress),
                   dynamic_ncols=True)
        start, start_tokens = time.perf_counter(), self.tokens_seen
        while self.step < t.max_steps:
            metrics = self.train_step()
            self.step += 1
            self.tokens_seen += int(metrics["tokens"])
            tok_s = (self.tokens_seen - start_tokens) / (time.perf_counter() - start)
            metrics["tokens_per_s"] = tok_s
            if self.step % t.log_every == 0 or self.step == t.max_steps:
                self.logger.log(self.step, "train", metrics)
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc0=f"{metrics.get('acc_0', 0):.3f}", tok_s=f"{tok_s:,.0f}")
            if t.eval_every and self.step % t.eval_every == 0 and self.step < t.max_steps:
                self._log_eval()
            if self.step % t.save_every == 0 and self.step < t.max_steps:
                self.save()
        bar.close()
        final_eval = self._log_eval()
        self.save()
        self.export_draft(Path(self.config.output_dir) / "final")
        self.logger.close()
        return final_eval

    def _log_eval(self) -> dict[str, float] | None:
        metrics = self.evaluate()
        if self.decode_eval is not None:
            decoded = self.decode_eval(self.backend.full_state_dict())  # full_state_dict is collective
            if decoded is not None:
                metrics = {**(metrics or {}), **decoded}
        if metrics is not None:
            self.logger.log(self.step, "eval", metrics)
            if self.info.is_main:
                accs = " ".join(f"{metrics[f'acc_{k}']:.3f}" for k in range(100) if f"acc_{k}" in metrics)
                tau = f"  decode tau {metrics['decode_tau']:.3f}" if "decode_tau" in metrics else ""
                tqdm.write(f"eval step {self.step}: loss {metrics.get('loss', float('nan')):.4f}  acc/step [{accs}]  "
                           f"sim accept len {metrics.get('sim_accept_len', float('nan')):.3f}{tau}")
        return metrics
