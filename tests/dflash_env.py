"""The virtual environment with z-lab's ``dflash`` package (tests/reader_env.py; cached under
``~/.cache/headstart/dflash-0.1.0``). ``python tests/dflash_env.py`` builds it (CI does, before the tests) and prints
its python."""

from __future__ import annotations

from pathlib import Path

from reader_env import reader_python

REQUIREMENTS = Path(__file__).with_name("dflash-requirements.txt")


def dflash_python() -> Path:
    return reader_python("dflash-0.1.0", REQUIREMENTS, ("dflash",), "from dflash.model import DFlashDraftModel, dflash_generate")


if __name__ == "__main__":
    print(dflash_python())
