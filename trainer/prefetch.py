"""``train.prefetch``: the next micro-batch's features computed on a worker thread while this one trains.

A step is features (the target's forward online, the store's read offline) then the head's forward and backward.
The features of the next micro-batch depend on nothing the head does, so one worker thread computes them while the
main thread runs the head: on a GPU the two threads issue their kernels side by side (a small model's step spends
most of its time issuing kernels), and an offline run reads the next batch
from disk meanwhile. The worker issues its kernels on the stream the main thread was on when it started the work,
so they run in issue order with the head's and the main thread takes the features only after the worker has issued
everything that computes them: no events needed. (The GPU runs the two threads' kernels one after another; what
overlaps is the host's work of issuing them, and a disk read.)

The worker is idle outside ``Trainer.train_step`` (the step waits for it before its optimizer step), so evaluation,
checkpoints and the decode evaluation never share the target or the store with it. An error on the worker is raised
where the features are taken, after the step's own checks: a corrupt shard stops every rank together at that step's
check, as without prefetching; any other error is the step's.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Hashable

import torch

from headstart.models.head import Features


class FeaturePrefetch:
    """One worker thread and at most one batch of features in flight, named by a key (the batch's dataset rows)."""

    def __init__(self, device: torch.device) -> None:
        # One worker: features run one batch at a time, in order (the target's aux capture is per call).
        self.cuda = device.type == "cuda"
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="features",
                                       initializer=torch.cuda.set_device if self.cuda else None,
                                       initargs=(device,) if self.cuda else ())
        self.pending: tuple[Hashable, Future] | None = None

    def start(self, key: Hashable, compute: Callable[[], Features]) -> None:
        """Begin computing the features called ``key`` on the worker, on the caller's current CUDA stream."""
        self.wait()
        if self.cuda:
            stream = torch.cuda.current_stream()
            work = compute

            def compute() -> Features:
                with torch.cuda.stream(stream):
                    return work()
        self.pending = (key, self.pool.submit(compute))

    def take(self, key: Hashable) -> Features | None:
        """The features called ``key`` if the worker was computing them (its error, if it failed, raised here), else
        None: the caller computes them itself."""
        pending, self.pending = self.pending, None
        if pending is None or pending[0] != key:
            if pending is not None:
                pending[1].exception()  # waits: the worker never runs beside the caller's own features
            return None
        return pending[1].result()

    def wait(self) -> None:
        """Until the worker is idle (its result, if any, is kept for ``take``)."""
        if self.pending is not None:
            self.pending[1].exception()  # waits; an error is raised by ``take``

    def drop(self) -> None:
        """Let go of the features computed ahead (evaluation and checkpoints run without holding them)."""
        self.wait()
        self.pending = None
