"""trainer/progress.py: a progress bar that reads in a redirected log."""

from __future__ import annotations

import io

from headstart.trainer.progress import progress_bar


def test_a_redirected_bar_prints_whole_throttled_lines():
    log = io.StringIO()  # not a terminal
    bar = progress_bar(total=500, desc="train", file=log, log_interval=3600)
    for step in range(500):
        bar.set_postfix(loss=f"{1 / (step + 1):.3f}", refresh=False)
        bar.update(1)
    bar.close()
    text = log.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    # the first draw and the closing one; 500 updates within the interval print nothing in between
    assert len(lines) == 2, lines
    assert lines[-1].startswith("train: 100%") and "500/500" in lines[-1] and "loss=0.002" in lines[-1]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_the_usual_redraws():
    term = _Terminal()
    bar = progress_bar(total=3, desc="x", file=term, mininterval=0)
    for _ in range(3):
        bar.update(1)
    bar.close()
    assert "\r" in term.getvalue()
