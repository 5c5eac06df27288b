"""``speculators train`` (vLLM's speculators 0.9.0) on a CPU, for benchmarks/versus_speculators.py: its trainer as
released, with four accelerator assumptions replaced at run time (nothing in its package is edited), and its logged
metrics also written to a JSONL file. Runs in the speculators virtual environment (tests/speculators_env.py), one
process (its torchrun path needs an accelerator):

    ~/.cache/headstart/speculators-0.9.0/bin/python benchmarks/speculators_cpu.py --metrics-jsonl OUT/metrics.jsonl \\
        <speculators train flags> --draft-attn-impl sdpa --loss-implementation eager --num-workers 0

What is replaced, and why (speculators/train/ in 0.9.0):
- ``torch.accelerator.synchronize`` (trainer.py, every logged step): raises without an accelerator; a no-op here.
- ``get_local_rank`` in trainer.py: its integer 0 is used as a device, which torch reads as the (missing)
  accelerator; the CPU here.
- ``get_current_device`` in checkpointer.py: "cuda:0" on a resume; the CPU here.
- the trainer's autocast device type: "cuda" unless set; "cpu" here (fp32 hidden states: autocast is then a no-op).
Flex attention has no CPU backward and the fused loss needs Triton: the flags above choose speculators' own
alternatives.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import torch

torch.accelerator.synchronize = lambda *args, **kwargs: None

import speculators.train.checkpointer as checkpointer  # noqa: E402
import speculators.train.cli as cli  # noqa: E402
import speculators.train.trainer as trainer  # noqa: E402
from speculators.train.config import TrainConfig  # noqa: E402

trainer.get_local_rank = lambda: torch.device("cpu")
checkpointer.get_current_device = lambda: "cpu"
_init = trainer.Trainer.__init__


def _cpu_init(self, *args, **kwargs) -> None:
    _init(self, *args, **kwargs)
    self.device_type = "cpu"


trainer.Trainer.__init__ = _cpu_init


class JsonLines(logging.Handler):
    """speculators logs its metrics as dicts on the ``speculators.metrics`` logger: each one a JSON line."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.file = open(path, "a")  # noqa: SIM115 -- open for the process's life

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict) and not getattr(record, "hparams", False):
            self.file.write(json.dumps({"time": record.created, **record.msg}, default=float) + "\n")
            self.file.flush()


_setup_metric_logger = cli.setup_metric_logger


METRICS = ["metrics.jsonl"]  # --metrics-jsonl PATH


def _with_jsonl(*args, **kwargs):
    _setup_metric_logger(*args, **kwargs)
    logging.getLogger("speculators.metrics").addHandler(JsonLines(METRICS[0]))


cli.setup_metric_logger = _with_jsonl

if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:
        raise SystemExit("run it as one process: speculators' distributed path needs an accelerator")
    argv = sys.argv[1:]
    if "--metrics-jsonl" in argv:
        at = argv.index("--metrics-jsonl")
        METRICS[0] = argv[at + 1]
        del argv[at:at + 2]
    cli.main(TrainConfig.resolve(argv))
