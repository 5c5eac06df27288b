"""``train.prefetch``: the next micro-batch's features computed on a worker thread while this one trains.

A step is features (the target's forward online, the store's read offline) then the head's forward and backward.
The features of the next micro-batch depend on nothing the head does, so one worker thread computes them while the
main thread runs the head: on a GPU the two threads launch their kernels side by side (a small model's step is
launch-bound: BENCHMARKS.md "Training step on a GPU"), and an offline run reads the next batch from disk meanwhile.
Both threads use the same CUDA stream, so the kernels run in launch order and no event or stream bookkeeping is
needed: the main thread takes the features only after the worker has launched everything that computes them.

The worker is idle outside ``Trainer.train_step`` (the step waits for it before its optimizer step), so evaluation,
checkpoints and the decode evaluation never share the target or the store with it. A prefetch that fails is
dropped, not raised: the step that needs those features computes them itself, after its own checks (a corrupt
shard then stops every rank together, as without prefetching).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Hashable

import torch

from headstart.models.head import Features


class FeaturePrefetch:
    def __init__(self, device: torch.device) -> None:
        # One worker: features run one batch at a time, in order (the target's aux capture is per call).
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="features",
                                       initializer=torch.cuda.set_device if device.type == "cuda" else None,
                                       initargs=(device,) if device.type == "cuda" else ())
        self.pending: tuple[Hashable, Future] | None = None

    def start(self, key: Hashable, compute: Callable[[], Features]) -> None:
        """Begin computing the features called ``key`` (a (step, micro-batch) pair) on the worker."""
        self.wait()
        self.pending = (key, self.pool.submit(compute))

    def take(self, key: Hashable) -> Features | None:
        """The features called ``key`` if the worker computed them, else None (not started, another key, or failed:
        the caller computes them itself)."""
        if self.pending is None or self.pending[0] != key:
            self.wait()
            self.pending = None
            return None
        _, future = self.pending
        self.pending = None
        return None if future.exception() is not None else future.result()

    def wait(self) -> None:
        """Until the worker is idle (its result, if any, is kept for ``take``)."""
        if self.pending is not None:
            self.pending[1].exception()  # waits; an error is the taker's to drop
