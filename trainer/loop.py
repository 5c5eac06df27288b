"""The one training loop, for every head and both backends.

    train() -> train_step() -> forward_backward()      (torchtitan's shape)

A step: ``grad_accum`` micro-batches, each: online target features -> ``head.loss`` -> backward;
then clip + optimizer step. Metrics are reduced across ranks with one all-reduce per step.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import time
import warnings
from pathlib import Path
from typing import Callable

import datasets
import torch
from tqdm import tqdm

from headstart.trainer.progress import progress_bar

from headstart.models.export import replace_dir
from headstart.models.head import Features, trained_positions
from headstart.trainer.batches import BatchPlan, collate
from headstart.trainer.checkpoint import latest_checkpoint, save_checkpoint, written
from headstart.trainer.config import RunConfig
from headstart.trainer.distributed import DistInfo, all_reduce_sum
from headstart.trainer.feature_store import REBUILD, CorruptShardError
from headstart.trainer.metrics import MetricsLogger


MACHINE_METRICS = frozenset({"tokens_per_s", "peak_mem_gib"})
"""Logged metrics that depend on the clock and the machine, not on what was trained: a resumed run's log
equals an uninterrupted one's without them."""

BEST_RECORD = "best.json"
"""In ``output_dir/best/``: the step and the metric it was chosen by."""


def peak_memory_gib(device: torch.device) -> float:
    """This process's peak memory so far: CUDA's max allocated tensors on a GPU, the peak RSS on a CPU (the
    target's weights included, as a user's machine has to hold them)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


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
        self.plan = BatchPlan(len(train_data), t.batch_size, info.world_size, info.rank, t.grad_accum, t.seed)
        self.step = 0
        self.tokens_seen = 0
        self.best: dict | None = None  # {"step", "metric", "value"} of the head in output_dir/best/
        self.target_fingerprint: dict | None = None  # set by build_trainer: checkpoints record it

    # -- checkpoints ----------------------------------------------------------------------------
    def export_draft(self, directory: Path) -> None:
        state = self.backend.full_state_dict()  # collective
        if self.info.is_main:
            self.export_draft_fn(state, directory)

    def save(self) -> Path:
        return save_checkpoint(
            self.config.output_dir, self.step, self.info, self.backend.save, self.export_draft,
            {"step": self.step, "tokens_seen": self.tokens_seen, "world_size": self.info.world_size,
             "global_batch": self.plan.global_batch, "rows_seen": self.plan.rows_seen(self.step),
             "identity": self.identity()},
            keep=self.config.train.keep_checkpoints,
        )

    def resume(self) -> bool:
        path = latest_checkpoint(self.config.output_dir)
        if path is None:  # killed before its first checkpoint: start again, without the steps it logged
            self._drop_metrics_after(0)
            return False
        state = json.loads((path / "trainer_state.json").read_text())
        self._check_same_run(path, state.get("identity"))
        t = self.config.train
        # Checkpoints from before global_batch was recorded: their world size x this recipe's split.
        old_batch = state.get("global_batch", state["world_size"] * t.batch_size * t.grad_accum)
        rows_seen = state.get("rows_seen", state["step"] * old_batch)
        if old_batch != self.plan.global_batch and self.info.is_main:
            warnings.warn(f"{path} was trained with a global batch of {old_batch} sequences, this run has "
                          f"{self.plan.global_batch} (batch_size {t.batch_size} x {self.info.world_size} ranks x grad_accum "
                          f"{t.grad_accum}): it continues at the first of the {rows_seen} rows not yet seen, but its steps "
                          f"are not those of an uninterrupted run", stacklevel=2)
        self.backend.load(path / "state", state["world_size"])
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.plan.resume_at(self.step, rows_seen)
        self._drop_metrics_after(self.step)
        self.best = self._logged_best()
        self._settle_best_dir()
        return True

    def _settle_best_dir(self) -> None:
        """After a kill: put back a best/ caught between its two renames. A best/ exported after the checkpoint
        the run resumes from is kept (the one before it was replaced by it, so deleting it would lose both); the
        resumed run compares with the best its kept log names and replaces best/ when it evaluates that far."""
        if not self.info.is_main:
            return
        best, old = Path(self.config.output_dir) / "best", Path(self.config.output_dir) / ".old-best"
        if old.is_dir() and not best.exists():
            os.replace(old, best)
        record = best / BEST_RECORD
        if record.is_file() and json.loads(record.read_text())["step"] > self.step:
            print(f"{best} holds the head of step {json.loads(record.read_text())['step']}, after the checkpoint this "
                  f"run resumes from (step {self.step}); it is replaced when the resumed run evaluates that far")

    def _logged_best(self) -> dict | None:
        """The last best-head choice the interrupted run logged up to its checkpoint: later ones are made again."""
        if not self.info.is_main or not self.logger.path.exists():
            return None
        best = None
        for line in self.logger.path.read_text().splitlines():
            record = json.loads(line)
            if record["split"] == "best":
                (metric, value), = ((k, v) for k, v in record.items() if k not in ("step", "split"))
                best = {"step": record["step"], "metric": metric, "value": value}
        return best

    def identity(self) -> dict:
        """What a checkpoint can only continue with: the head type, the target, every tensor's shape and the
        draft vocab (the head's integer tensors, d2t/t2d). The same on every rank (global shapes)."""
        state = self.backend.module.state_dict()
        shapes = {n: list(getattr(p, "ds_shape", p.shape)) for n, p in self.backend.module.named_parameters()}
        ints = hashlib.sha256()
        for name in sorted(state):
            if not state[name].is_floating_point():
                ints.update(name.encode() + state[name].detach().cpu().contiguous().numpy().tobytes())
        target = self.target_fingerprint or {}
        backend = self.config.parallel.backend + (f" ZeRO-{self.backend.zero_stage}" if hasattr(self.backend, "zero_stage") else "")
        return {"head": self.config.draft.head, "backend": backend, "optimizer": self.config.train.optimizer,
                "shapes": shapes, "vocab_sha256": ints.hexdigest(),
                "target": {k: target.get(k) for k in ("config_sha256", "tokenizer_sha256", "name_or_path")}}

    def _check_same_run(self, path: Path, saved: dict | None) -> None:
        """Refuse, naming the difference, a checkpoint this run cannot continue (every rank alike)."""
        if saved is None:  # written before identities were recorded
            return
        now = self.identity()
        problems = []
        if saved.get("backend", now["backend"]) != now["backend"]:
            problems.append(f"it was written by {saved['backend']}, this run uses {now['backend']}")
        if saved.get("optimizer", "adamw") != now["optimizer"]:  # (checkpoints before the option: AdamW)
            problems.append(f"its optimizer state is {saved.get('optimizer', 'adamw')}'s, this run uses {now['optimizer']}")
        if saved["head"] != now["head"]:
            problems.append(f"it trains a {saved['head']} head, this run a {now['head']} head")
        for key, what in (("config_sha256", "config"), ("tokenizer_sha256", "tokenizer")):
            if saved["target"].get(key) != now["target"].get(key):
                problems.append(f"its target ({saved['target'].get('name_or_path')}) has another {what} than this run's "
                                f"({now['target'].get('name_or_path')})")
        if saved["head"] == now["head"] and saved["shapes"] != now["shapes"]:
            differ = sorted(n for n in set(saved["shapes"]) | set(now["shapes"])
                            if saved["shapes"].get(n) != now["shapes"].get(n))
            problems.append("its tensors have other shapes: " + ", ".join(
                f"{n} {saved['shapes'].get(n)} there vs {now['shapes'].get(n)} here" for n in differ[:4]))
        elif saved["vocab_sha256"] != now["vocab_sha256"]:
            problems.append("its draft vocab (d2t/t2d) differs: this run's training data or draft_vocab_size built another")
        if problems:
            raise ValueError(f"cannot resume {path}: " + "; ".join(problems) + ". Resume it with its own recipe, or "
                             "start a new run (--overwrite, or another output_dir)")

    def _drop_metrics_after(self, step: int) -> None:
        """Metrics the interrupted run logged after its last checkpoint: those steps are trained again."""
        if self.info.is_main and self.logger.path.exists():
            lines = self.logger.path.read_text().splitlines()
            kept = [line for line in lines if _logged_step(line) <= step]
            tmp = self.logger.path.with_name(f".{self.logger.path.name}.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, self.logger.path)  # a kill now leaves the old log or the new, never a cut one

    # -- training -------------------------------------------------------------------------------
    def forward_backward(self, batch: dict[str, torch.Tensor], last_micro: bool, denominator: float) -> dict[str, float]:
        features = self.features(batch)
        features.loss_denominator = denominator
        with autocast_context(self.config.train.mixed_precision, self.info.device):
            loss, metrics = self.backend.forward(features)
        self.backend.backward(loss, last_micro)
        return {"loss": float(loss.detach()), **metrics, "tokens": float(batch["attention_mask"].sum())}

    def train_step(self) -> dict[str, float]:
        accum = self.config.train.grad_accum
        batches = [collate(self.train_data, self.plan.rows(self.step, micro)) for micro in range(accum)]
        self._check_sources(batches)
        # The loss is the global batch's token mean (see models.head.loss_denominator): count its trained
        # positions over every micro-batch and rank before the first backward.
        trained = torch.tensor([float(sum(trained_positions(b["loss_mask"]) for b in batches))], dtype=torch.float64)
        trained = float(all_reduce_sum(trained.to(self.info.device)))
        denominator = max(trained, 1.0) / (accum * self.info.world_size)
        micro_metrics = [self.forward_backward(b, micro == accum - 1, denominator) for micro, b in enumerate(batches)]
        grad_norm = self.backend.step()
        metrics = self._reduce(micro_metrics)
        metrics.update(grad_norm=grad_norm, lr=self.backend.lr, epoch=self.plan.epoch_of(self.step + 1))
        return metrics

    def _keep_best(self, metrics: dict[str, float]) -> None:
        """Collective. Export the head to ``output_dir/best/`` when this evaluation beats every earlier one:
        by decode tau when decode evaluation is on (what a server gets), else by the simulated acceptance
        length. Acceptance often peaks before the loss stops falling; ``best/`` is that head."""
        key = "decode_tau" if self.decode_eval is not None else "sim_accept_len"
        value = metrics.get(key)  # decode_tau exists on rank 0 only: rank 0 decides
        previous = self.best if self.best is not None and self.best["metric"] == key else None
        better = [self.info.is_main and value is not None and (previous is None or value > previous["value"])]
        if self.info.world_size > 1:
            torch.distributed.broadcast_object_list(better, src=0)
        if not better[0]:
            return
        out = Path(self.config.output_dir)
        staging = out / ".best-staging"
        with written("the best head", latest_checkpoint(out), cleanup=staging if self.info.is_main else None):
            self.export_draft(staging)  # collective gather; rank 0 writes
            if self.info.is_main:
                (staging / BEST_RECORD).write_text(json.dumps({"step": self.step, "metric": key, "value": value}, indent=2))
                replace_dir(staging, out / "best")  # the previous best stays whole until this one is in place
        if self.info.is_main:
            self.best = {"step": self.step, "metric": key, "value": value}
            self.logger.log(self.step, "best", {key: value})
            tqdm.write(f"best head so far: step {self.step}, {key} {value:.3f} -> {out / 'best'}")

    def _check_sources(self, batches: list[dict[str, torch.Tensor]]) -> None:
        """Every rank checks what this step's features are read from (stored shards) before any forward, and
        all learn every rank's problems: the run stops on all ranks together, before the optimizer step,
        naming every refused shard -- not with one rank dead and the others hung in a collective."""
        if not getattr(self.features, "on_disk", True):  # the same on every rank: one recipe
            return
        rows = [r for b in batches if "row" in b for r in b["row"].tolist()]
        problems = self.features.problems(rows)
        if self.info.world_size > 1:
            gathered: list[list[str] | None] = [None] * self.info.world_size
            torch.distributed.all_gather_object(gathered, problems)
            problems = [p for rank_problems in gathered for p in rank_problems or []]
        if problems:
            raise CorruptShardError(f"step {self.step + 1} cannot read its features: " + "; ".join(dict.fromkeys(problems))
                                    + f". {REBUILD}")

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
        # Resumed from the final checkpoint (killed while exporting final/): its evaluation is logged already.
        trained_before = self.step >= t.max_steps
        bar = progress_bar(total=t.max_steps, initial=self.step, desc="train", disable=not (self.info.is_main and self.config.logging.progress),
                   dynamic_ncols=True)
        start, start_tokens = time.perf_counter(), self.tokens_seen
        while self.step < t.max_steps:
            metrics = self.train_step()
            self.step += 1
            self.tokens_seen += int(metrics["tokens"])
            tok_s = (self.tokens_seen - start_tokens) / (time.perf_counter() - start)
            metrics["tokens_per_s"] = tok_s
            metrics["peak_mem_gib"] = peak_memory_gib(self.info.device)  # rank 0's, as the bar shows it
            if self.step % t.log_every == 0 or self.step == t.max_steps:
                self.logger.log(self.step, "train", metrics)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc0=f"{metrics.get('acc_0', 0):.3f}", tok_s=f"{tok_s:,.0f}",
                            mem=f"{metrics['peak_mem_gib']:.1f}G", refresh=False)  # shown by update's (throttled) redraw
            bar.update(1)
            if t.eval_every and self.step % t.eval_every == 0 and self.step < t.max_steps:
                self._log_eval()
            if self.step % t.save_every == 0 and self.step < t.max_steps:
                self.save()
        bar.close()
        final_eval = None
        if not trained_before:
            final_eval = self._log_eval()
            self.save()
        with written("the final head", latest_checkpoint(self.config.output_dir)):
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
            if self.config.train.eval_every:  # one evaluation (the final) is no choice: best/ would be final/
                self._keep_best(metrics)
            if self.info.is_main:
                accs = " ".join(f"{metrics[f'acc_{k}']:.3f}" for k in range(100) if f"acc_{k}" in metrics)
                tau = f"  decode tau {metrics['decode_tau']:.3f}" if "decode_tau" in metrics else ""
                tqdm.write(f"eval step {self.step}: loss {metrics.get('loss', float('nan')):.4f}  acc/step [{accs}]  "
                           f"sim accept len {metrics.get('sim_accept_len', float('nan')):.3f}{tau}")
        return metrics


def _logged_step(line: str) -> float:
    """The step of a metrics.jsonl line; a line a kill cut short counts as after every checkpoint."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")
