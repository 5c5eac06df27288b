"""Where a decoding loop's time goes, by part: what the benchmark's per-round split is made of.

``lap(part)`` adds the time since the previous lap to ``part``, so the parts add up to the loop's wall time.
On a GPU every lap synchronises first (a part's kernels finish inside its own lap): a few microseconds per
lap, paid only by runs that ask for the split. ``UNTIMED`` costs nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

PARTS = ("prefill", "draft", "update", "verify", "other", "learn")
"""prefill: the prompt (the target's forward over it, then the drafter reading it); draft: the drafter proposing (a
chain's k steps, or growing a tree); update: the drafter reading the accepted tokens (its own forward); verify: the
target's forward over the drafts; other: everything else (acceptance, cache commit or rollback, bookkeeping, the host
sync); learn: the drafter learning from the request it just served (an n-gram datastore's counts, an online head's
optimizer steps: ``Drafter.finish``)."""


class RoundClock:
    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.mark = time.perf_counter()

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.mark = time.perf_counter()

    def lap(self, part: str) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.seconds[part] += now - self.mark
        self.mark = now


class _Untimed:
    def start(self) -> None:
        pass

    def lap(self, part: str) -> None:
        pass


UNTIMED = _Untimed()


def median_seconds(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls (after one warm-up), synchronised on a GPU."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
