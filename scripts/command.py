"""How every ``headstart`` command ends: a refusal of bad input in one line, a bug with its traceback.

``@refusals`` wraps a script's ``main``: a ``UserError`` (models/errors.py), or any ``ValueError``/``OSError``
raised by the checks of what the user gave, prints ``error: <message>`` as one line on stderr (under torchrun into
its error file: trainer/errors.py) and returns 2. ``entry_point`` runs a command as a process does (``headstart
NAME``, ``python scripts/NAME.py``): anything else that escapes is a bug in headstart, shown with its traceback and a
line saying so. Set ``HEADSTART_TRACEBACK=1`` to see a refusal's traceback too.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
from collections.abc import Callable

from headstart.models.errors import UserError
from headstart.trainer.errors import report_error

REFUSED = (ValueError, OSError, ImportError)
"""What a command reports as a refusal: UserError and the ValueError/OSError subclasses that name the file, row or
key (RowError, OtherTargetError, CorruptShardError, WriteError, a missing file...); ImportError: an optional
dependency the user asked for and has not installed."""
BUG = ("this is a bug in headstart, not a problem with your input: please report it with the traceback above "
       "and the command you ran")


def refusals(main: Callable[..., int | None]) -> Callable[[list[str] | None], int]:
    """``main(argv)`` whose refusals print one line and exit 2; its other exceptions pass through."""

    @functools.wraps(main)
    def run(argv: list[str] | None = None) -> int:
        try:
            code = main(argv)
        except REFUSED as err:
            if os.environ.get("HEADSTART_TRACEBACK"):
                raise
            return report_error(err)
        return code if isinstance(code, int) else 0

    return run


def entry_point(main: Callable[[], int | None]) -> int:
    """Run a command's ``main`` as a process: its exit code; a bug's traceback followed by one line saying so."""
    try:
        code = main()
    except (SystemExit, KeyboardInterrupt):
        raise
    except Exception:
        traceback.print_exc()
        print(f"headstart: {BUG}", file=sys.stderr)
        return 1
    return code if isinstance(code, int) else 0


def check_at_least(**values: tuple[float | None, float]) -> None:
    """Refuse, by flag, a number below its least value: ``check_at_least(max_length=(args.max_length, 1))`` refuses
    ``--max-length 0``. None (not given) passes."""
    for name, (value, least) in values.items():
        if value is not None and value < least:
            raise UserError(f"--{name.replace('_', '-')} {value}: must be >= {least}")
