"""Progress bars that also read well in a redirected log.

On a terminal this is tqdm as usual. When stderr is a file or a pipe (``nohup ... > train.log``, a
cluster's job log), tqdm's carriage-return redraws pile up into one endless line; there the bar is
printed as a whole line every ``log_interval`` seconds instead, so ``tail -f`` shows rate and ETA.
"""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm


class _Lines:
    """A stream that turns tqdm's ``\\r``-redraws into separate lines."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").rstrip("\n")
        if text.strip():
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(*args: Any, log_interval: float = 30.0, **kwargs: Any) -> tqdm:
    """``tqdm(*args, **kwargs)``; in a redirected log, one line per ``log_interval`` seconds."""
    stream = kwargs.pop("file", sys.stderr)
    if getattr(stream, "isatty", lambda: False)():
        return tqdm(*args, file=stream, **kwargs)
    kwargs.update(mininterval=log_interval, maxinterval=log_interval, dynamic_ncols=False, ncols=120)
    return tqdm(*args, file=_Lines(stream), **kwargs)
