"""A user error (bad config, missing file, a corrupt shard) printed once, where a user reads it.

Plain ``python``: one ``error: ...`` line on stderr. Under torchrun every rank usually hits the same
error, and torchrun ends with its own ChildFailedError report, so printing from each rank buries the
line under ~40 lines. Instead the failing rank writes the line into torchrun's error file
(TORCHELASTIC_ERROR_FILE), which torchrun prints as the last block of its report. Ranks other than 0
wait a moment first: when rank 0 fails too, torchrun reports rank 0 alone and stops the others, so the
line appears once; when only that rank failed (its own shard was corrupt), it is reported after the wait.
"""

from __future__ import annotations

import json
import os
import sys
import time

from headstart.models.errors import one_line

OTHER_RANKS_WAIT_S = 5.0


def report_error(err: BaseException | str) -> int:
    """Print or record ``err`` for the user, on one line; returns the exit code (2)."""
    message = f"error: {one_line(err)}"
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        print(message, file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) != 0:
        time.sleep(OTHER_RANKS_WAIT_S)
    with open(error_file, "w") as f:  # torchrun's format: it prints py_callstack under "traceback"
        json.dump({"message": {"message": message, "extraInfo": {"py_callstack": message,
                                                                 "timestamp": str(int(time.time()))}}}, f)
    return 2
