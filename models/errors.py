"""Bad input, told to the user in one line: what, where, why, and what to do.

Every layer raises ``UserError`` (or a ``ValueError``/``OSError`` that names the file, row, key or flag) where it
checks what a user gave; the commands catch it once (scripts/command.py) and print ``error: <message>`` on one line,
exit 2, no traceback. Anything else that escapes a command is a bug in headstart and keeps its traceback.
"""

from __future__ import annotations


class UserError(ValueError):
    """A refusal of something the user gave (a file, a flag, a recipe key): the message names it and says what to do."""


def one_line(err: BaseException | str) -> str:
    """``err``'s message on one line: a multi-line message (a list of bad rows) keeps its lines, joined by "; "."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:  # e.g. a bare FileNotFoundError(): at least say what it was
        return type(err).__name__ if isinstance(err, BaseException) else ""
    joined = lines[0]
    for line in lines[1:]:
        joined += (" " if joined[-1] in ":;,." else "; ") + line
    return joined
