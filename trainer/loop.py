"""The one training loop, for every head and both backends.

    train() -> train_step() -> forward_backward()      (torchtitan's shape)

A step: ``grad_accum`` micro-batches, each: online target features -> ``head.loss`` -> backward;
then clip + optimizer step. Metrics are reduced across ranks with one all-reduce per step. The run's files
(checkpoints, resume, best/, metrics.jsonl) belong to trainer/run_dir.py.
"""

from __future__ import annotations

import contextlib
import resource
import time
import warnings
from pathlib import Path
from typing import Callable

import datasets
import torch
from torch.profiler import record_function
from tqdm import tqdm

from headstart.models.head import SUMS, Features, step_metrics, trained_positions
from headstart.trainer.batches import BatchPlan, collate, row_work
from headstart.trainer.config import RunConfig
from headstart.trainer.distributed import DistInfo, all_reduce_sum
from headstart.trainer.feature_store import REBUILD, CorruptShardError
from headstart.trainer.metrics import MetricsLogger
from headstart.trainer.prefetch import FeaturePrefetch
from headstart.trainer.progress import progress_bar
from headstart.trainer.run_dir import RunDirectory, run_identity


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


def prefetch_key(batch: dict[str, torch.Tensor]) -> tuple[int, ...]:
    """What names a micro-batch's features for ``train.prefetch``: its dataset rows (a step's rows change with the
    plan -- a resume, another world size -- and a key of them cannot go stale)."""
    return tuple(batch["row"].tolist())


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
        self.run_dir = RunDirectory(config.output_dir, info, logger)
        t = config.train
        # Ranks wait for each other at every collective: deal each step's rows so that each rank's work is level.
        # Packed only: a packed micro-batch costs its tokens; a padded one its rows x its longest, which dealing the
        # long rows apart would raise.
        self.plan = BatchPlan(len(train_data), t.batch_size, info.world_size, info.rank, t.grad_accum, t.seed,
                              work=row_work(train_data) if config.data.packing else None,
                              max_tokens=t.batch_size * config.data.max_length)
        self.step = 0
        self.tokens_seen = 0
        # The target's forward is collective when its layers are sharded: it stays on the thread of the other collectives.
        sharded_target = config.parallel.shard_target and info.world_size > 1 and config.features.path is None
        if t.prefetch and sharded_target and info.is_main:
            warnings.warn("train.prefetch is off: parallel.shard_target makes the target's forward collective, and "
                          "collectives stay on the training thread", stacklevel=2)
        self.prefetch = FeaturePrefetch(info.device) if t.prefetch and not sharded_target else None
        self._step_batches: list[dict[str, torch.Tensor]] = []  # this step's micro-batches, for the prefetch worker
        self._next_first: tuple[int, dict[str, torch.Tensor]] | None = None  # (step, its first micro-batch) prefetched
        self.target_fingerprint: dict | None = None  # set by build_trainer: checkpoints record it

    # -- checkpoints ----------------------------------------------------------------------------
    def export_draft(self, directory: Path) -> None:
        state = self.backend.full_state_dict()  # collective
        if self.info.is_main:
            self.export_draft_fn(state, directory)

    def identity(self) -> dict:
        backend = self.config.parallel.backend + (f" ZeRO-{self.backend.zero_stage}" if hasattr(self.backend, "zero_stage") else "")
        return run_identity(self.backend.module, self.config.draft.head, backend, self.config.train.optimizer,
                            self.target_fingerprint)

    def save(self) -> Path:
        return self.run_dir.save(
            self.step, self.backend.save, self.export_draft,
            {"step": self.step, "tokens_seen": self.tokens_seen, "world_size": self.info.world_size,
             "global_batch": self.plan.global_batch, "rows_seen": self.plan.rows_seen(self.step),
             "identity": self.identity()},
            keep=self.config.train.keep_checkpoints,
        )

    def resume(self) -> bool:
        found = self.run_dir.resume_state(self.identity())
        if found is None:  # killed before its first checkpoint: start again
            return False
        path, state = found
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
        self.run_dir.resumed_at(self.step)
        return True

    # -- training -------------------------------------------------------------------------------
    def forward_backward(self, batch: dict[str, torch.Tensor], last_micro: bool, denominator: float,
                         full_metrics: bool = True, micro: int = 0) -> dict[str, float]:
        # The scopes name the parts of a step for torch.profiler (benchmarks/profile_step.py); free otherwise.
        with record_function("step: features"):
            features = self.prefetch.take(prefetch_key(batch)) if self.prefetch else None
            if features is None:
                features = self.features(batch)
        self._prefetch_after(micro)
        features.loss_denominator = denominator
        features.full_metrics = full_metrics
        with autocast_context(self.config.train.mixed_precision, self.info.device), record_function("step: head forward"):
            loss, metrics = self.backend.forward(features)
        with record_function("step: head backward"):
            self.backend.backward(loss, last_micro)
        return {"loss": float(loss.detach()), **metrics, "tokens": float(batch["attention_mask"].sum())}

    def batch(self, dataset, rows: list[int]) -> dict[str, torch.Tensor]:
        """The micro-batch of these dataset rows: padded, or packed when the recipe says ``data.packing``."""
        return collate(dataset, rows, self.config.data.pack_tokens(self.config.train.batch_size))

    def train_step(self) -> dict[str, float]:
        accum = self.config.train.grad_accum
        with record_function("step: data"):
            held, self._next_first = self._next_first, None  # collated once: by _prefetch_after, during the last step
            batches = [held[1] if micro == 0 and held and held[0] == self.step
                       else self.batch(self.train_data, self.plan.rows(self.step, micro)) for micro in range(accum)]
            self._step_batches = batches
        self._check_sources(batches)
        # The loss is the global batch's token mean (see models.head.loss_denominator): count its trained
        # positions over every micro-batch and rank before the first backward.
        trained = torch.tensor([float(sum(trained_positions(b["loss_mask"], b.get("position_ids")) for b in batches))],
                               dtype=torch.float64)
        trained = float(all_reduce_sum(trained.to(self.info.device)))
        denominator = max(trained, 1.0) / (accum * self.info.world_size)
        # Top-5 and sum min(p, q) cost a pass over the logits each (~4% of a SmolLM2 step): only for the logged steps.
        logged = self.logs(self.step + 1)
        micro_metrics = [self.forward_backward(b, micro == accum - 1, denominator, logged, micro)
                         for micro, b in enumerate(batches)]
        if self.prefetch:
            self.prefetch.wait()  # the worker is idle outside a step: evaluation and checkpoints have the target alone
        with record_function("step: optimizer"):
            grad_norm = self.backend.step()
        metrics = self._reduce(micro_metrics)
        metrics.update(grad_norm=grad_norm, lr=self.backend.lr, epoch=self.plan.epoch_of(self.step + 1))
        return metrics

    def _prefetch_after(self, micro: int) -> None:
        """Start the features of the micro-batch after (this step, ``micro``) on the prefetch worker: the next of
        this step's, or the next step's first."""
        if not self.prefetch:
            return
        step, micro = (self.step, micro + 1) if micro + 1 < self.config.train.grad_accum else (self.step + 1, 0)
        if step >= self.config.train.max_steps:
            return
        if step == self.step:
            batch = self._step_batches[micro]
        else:  # collated here, so the plan stays one thread's; kept for the next step's train_step
            batch = self.batch(self.train_data, self.plan.rows(step, micro))
            self._next_first = (step, batch)
        self.prefetch.start(prefetch_key(batch), lambda: self.features(batch))

    def logs(self, step: int) -> bool:
        """Whether the train metrics of ``step`` (counted from 1) go to metrics.jsonl / wandb."""
        t = self.config.train
        return step % t.log_every == 0 or step == t.max_steps

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
        """One all-reduce over micro-batches and ranks. The heads' per-step sums and counts (``SUMS``) and token
        counts are added up and the per-step metrics formed from them, so every trained token weighs the same; the
        loss (already a share of the global batch's token mean, see ``loss_denominator``) is averaged."""
        keys = sorted(records[0])
        local = torch.tensor([[r[k] for k in keys] for r in records], dtype=torch.float64).sum(0)
        total = dict(zip(keys, all_reduce_sum(local.to(self.info.device)).cpu().tolist()))
        n = len(records) * self.info.world_size
        sums = {k: v for k, v in total.items() if k.startswith(SUMS)}
        out = {k: (v if k in ("tokens", "valid_tokens") else v / n) for k, v in total.items() if not k.startswith(SUMS)}
        return {**out, **step_metrics(sums)} if sums else out

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
            features = self.features(self.batch(self.eval_data, rows))
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
            if self.logs(self.step):
                self.logger.log(self.step, "train", metrics)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc0=f"{metrics.get('acc_0', 0):.3f}", tok_s=f"{tok_s:,.0f}",
                            mem=f"{metrics['peak_mem_gib']:.1f}G", refresh=False)  # shown by update's (throttled) redraw
            bar.update(1)
            evaluates = t.eval_every and self.step % t.eval_every == 0 and self.step < t.max_steps
            saves = self.step % t.save_every == 0 and self.step < t.max_steps
            if self.prefetch and (evaluates or saves):
                self.prefetch.drop()  # not held through them (the next step computes its own)
            if evaluates:
                self._log_eval()
            if saves:
                self.save()
        bar.close()
        final_eval = None
        if not trained_before:
            final_eval = self._log_eval()
            self.save()
        self.run_dir.export_final(self.export_draft)
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
                # best/ by decode tau when decode evaluation is on (what a server gets), else by the simulated
                # acceptance length. Acceptance often peaks before the loss stops falling; best/ is that head.
                key = "decode_tau" if self.decode_eval is not None else "sim_accept_len"
                self.run_dir.keep_best(self.step, key, metrics.get(key), self.export_draft)  # decode_tau: rank 0 only
            if self.info.is_main:
                accs = " ".join(f"{metrics[f'acc_{k}']:.3f}" for k in range(100) if f"acc_{k}" in metrics)
                tau = f"  decode tau {metrics['decode_tau']:.3f}" if "decode_tau" in metrics else ""
                tqdm.write(f"eval step {self.step}: loss {metrics.get('loss', float('nan')):.4f}  acc/step [{accs}]  "
                           f"sim accept len {metrics.get('sim_accept_len', float('nan')):.3f}{tau}")
        return metrics

