"""Rank-0 metrics: a JSONL file always, wandb when enabled."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from headstart.trainer.config import LoggingConfig


class MetricsLogger:
    def __init__(self, output_dir: str | Path, config: LoggingConfig, run_config: dict[str, Any], is_main: bool) -> None:
        self.is_main = is_main
        self.path = Path(output_dir) / "metrics.jsonl"
        self.wandb_run = None
        if not is_main:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if config.wandb:
            import wandb

            self.wandb_run = wandb.init(project=config.project, name=config.run_name, config=run_config,
                                        dir=str(Path(output_dir)), resume="allow")

    def log(self, step: int, split: str, values: dict[str, float]) -> None:
        if not self.is_main:
            return
        record = {"step": step, "split": split, **values}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({f"{split}/{k}": v for k, v in values.items()}, step=step)

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
