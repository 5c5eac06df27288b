"""The virtual environment with vLLM's ``speculators`` package that the conformance tests read with
(tests/reader_env.py; cached under ``~/.cache/headstart/speculators-0.9.0``). ``python tests/speculators_env.py``
builds it (CI does, before the tests) and prints its python."""

from __future__ import annotations

from pathlib import Path

from reader_env import reader_python

REQUIREMENTS = Path(__file__).with_name("speculators-requirements.txt")


def speculators_python() -> Path:
    # speculators goes in without its dependencies: it also requires torchvision and torchaudio, which it does not
    # import on the paths the tests use and which have no CPU build on CI's machine
    return reader_python("speculators-0.9.0", REQUIREMENTS, ("speculators",),
                         "import speculators.models.eagle3, speculators.models.mtp")


if __name__ == "__main__":
    print(speculators_python())
