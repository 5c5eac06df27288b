"""A training run's directory: checkpoints, resume, the best head and the metrics log.

    <output_dir>/metrics.jsonl  checkpoints/step_N/  checkpoints/latest  best/ (+ best.json)  final/

The loop (trainer/loop.py) asks this module to save, to resume and to keep the best head; it never touches the
files itself. Every write leaves the previous state whole when a kill or a full disk stops it midway.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

from headstart.models.export import replace_dir
from headstart.trainer.checkpoint import latest_checkpoint, save_checkpoint, written
from headstart.trainer.distributed import DistInfo
from headstart.trainer.metrics import MetricsLogger

BEST_RECORD = "best.json"
"""In ``output_dir/best/``: the step and the metric it was chosen by."""

MACHINE_METRICS = frozenset({"tokens_per_s", "peak_mem_gib"})
"""Logged metrics that depend on the clock and the machine, not on what was trained: a resumed run's log
equals an uninterrupted one's without them."""


def run_identity(module: torch.nn.Module, head: str, backend: str, optimizer: str, target: dict | None) -> dict:
    """What a checkpoint can only continue with: the head type, the target, every tensor's shape and the draft
    vocab (the head's integer tensors, d2t/t2d). The same on every rank (global shapes)."""
    state = module.state_dict()
    shapes = {n: list(getattr(p, "ds_shape", p.shape)) for n, p in module.named_parameters()}
    ints = hashlib.sha256()
    for name in sorted(state):
        if not state[name].is_floating_point():
            ints.update(name.encode() + state[name].detach().cpu().contiguous().numpy().tobytes())
    target = target or {}
    return {"head": head, "backend": backend, "optimizer": optimizer, "shapes": shapes, "vocab_sha256": ints.hexdigest(),
            "target": {k: target.get(k) for k in ("config_sha256", "tokenizer_sha256", "name_or_path")}}


def check_same_run(path: Path, saved: dict | None, now: dict) -> None:
    """Refuse, naming the difference, a checkpoint this run cannot continue (every rank alike)."""
    if saved is None:  # written before identities were recorded
        return
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


class RunDirectory:
    """``output_dir`` of one run, seen from one rank: rank 0 writes, every rank takes part in collectives."""

    def __init__(self, output_dir: str | Path, info: DistInfo, logger: MetricsLogger) -> None:
        self.path, self.info, self.logger = Path(output_dir), info, logger
        self.best: dict | None = None  # {"step", "metric", "value"} of the head in best/

    # -- checkpoints ---------------------------------------------------------------------------
    def save(self, step: int, save_state: Callable[[Path], None], export_draft: Callable[[Path], None],
             trainer_state: dict[str, Any], keep: int) -> Path:
        """Collective: a checkpoint of ``step`` (the optimizer state, the head in its export layout, the loop's state)."""
        return save_checkpoint(self.path, step, self.info, save_state, export_draft, trainer_state, keep=keep)

    def resume_state(self, identity: dict) -> tuple[Path, dict] | None:
        """The latest checkpoint and its trainer state, refused by name if this run cannot continue it; None when
        the run was killed before its first checkpoint (its logged steps are then dropped: they run again)."""
        path = latest_checkpoint(self.path)
        if path is None:
            self.drop_metrics_after(0)
            return None
        state = json.loads((path / "trainer_state.json").read_text())
        check_same_run(path, state.get("identity"), identity)
        return path, state

    def resumed_at(self, step: int) -> None:
        """After the loop restored ``step``: drop the log past it and settle best/ as the kill left it."""
        self.drop_metrics_after(step)
        self.best = self._logged_best()
        self._settle_best_dir(step)

    def export_final(self, export_draft: Callable[[Path], None]) -> None:
        with written("the final head", latest_checkpoint(self.path)):
            export_draft(self.path / "final")

    # -- best/ ---------------------------------------------------------------------------------
    def keep_best(self, step: int, key: str, value: float | None, export_draft: Callable[[Path], None]) -> None:
        """Collective. Export the head to best/ when ``value`` of metric ``key`` (known on rank 0) beats every
        earlier evaluation by the same metric."""
        previous = self.best if self.best is not None and self.best["metric"] == key else None
        better = [self.info.is_main and value is not None and (previous is None or value > previous["value"])]
        if self.info.world_size > 1:
            torch.distributed.broadcast_object_list(better, src=0)
        if not better[0]:
            return
        staging = self.path / ".best-staging"
        with written("the best head", latest_checkpoint(self.path), cleanup=staging if self.info.is_main else None):
            export_draft(staging)  # collective gather; rank 0 writes
            if self.info.is_main:
                (staging / BEST_RECORD).write_text(json.dumps({"step": step, "metric": key, "value": value}, indent=2))
                replace_dir(staging, self.path / "best")  # the previous best stays whole until this one is in place
        if self.info.is_main:
            self.best = {"step": step, "metric": key, "value": value}
            self.logger.log(step, "best", {key: value})
            tqdm.write(f"best head so far: step {step}, {key} {value:.3f} -> {self.path / 'best'}")

    def _settle_best_dir(self, step: int) -> None:
        """After a kill: put back a best/ caught between its two renames. A best/ exported after the checkpoint
        the run resumes from is kept (the one before it was replaced by it, so deleting it would lose both); the
        resumed run compares with the best its kept log names and replaces best/ when it evaluates that far."""
        if not self.info.is_main:
            return
        best, old = self.path / "best", self.path / ".old-best"
        if old.is_dir() and not best.exists():
            os.replace(old, best)
        record = best / BEST_RECORD
        if record.is_file() and json.loads(record.read_text())["step"] > step:
            print(f"{best} holds the head of step {json.loads(record.read_text())['step']}, after the checkpoint this "
                  f"run resumes from (step {step}); it is replaced when the resumed run evaluates that far")

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

    # -- metrics.jsonl -------------------------------------------------------------------------
    def drop_metrics_after(self, step: int) -> None:
        """Metrics the interrupted run logged after its last checkpoint: those steps are trained again."""
        if self.info.is_main and self.logger.path.exists():
            lines = self.logger.path.read_text().splitlines()
            kept = [line for line in lines if _logged_step(line) <= step]
            tmp = self.logger.path.with_name(f".{self.logger.path.name}.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, self.logger.path)  # a kill now leaves the old log or the new, never a cut one


def _logged_step(line: str) -> float:
    """The step of a metrics.jsonl line; a line a kill cut short counts as after every checkpoint."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")
