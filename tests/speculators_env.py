"""The virtual environment with vLLM's ``speculators`` package that the conformance tests read with.

Built once and cached (``$HEADSTART_SPECULATORS_VENV``, default ``~/.cache/headstart/speculators-0.9.0``):
the same torch as this environment (``torch==<this version>``; on CI's machine a CPU build from
disk), then ``speculators`` without its dependencies and the rest of tests/speculators-requirements.txt.
``python tests/speculators_env.py`` builds it (CI does, before the tests) and prints its python.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

REQUIREMENTS = Path(__file__).with_name("speculators-requirements.txt")
DEFAULT = Path.home() / ".cache" / "headstart" / "speculators-0.9.0"


def venv_dir() -> Path:
    return Path(os.environ.get("HEADSTART_SPECULATORS_VENV", DEFAULT))


def speculators_python() -> Path:
    """The venv's python, building the venv first if it is not complete."""
    root = venv_dir()
    python, ready = root / "bin" / "python", root / ".headstart-ready"
    stamp = f"torch=={torch.__version__}\n{REQUIREMENTS.read_text()}"  # rebuilt when either changes
    if ready.is_file() and ready.read_text() == stamp:
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(root)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    lines = [x.split("#")[0].strip() for x in REQUIREMENTS.read_text().splitlines()]
    lines = [x for x in lines if x]
    speculators = [x for x in lines if x.startswith("speculators")]
    subprocess.run([*pip, f"torch=={torch.__version__.split('+')[0]}"], check=True)
    subprocess.run([*pip, "--no-deps", *speculators], check=True)
    subprocess.run([*pip, *[x for x in lines if x not in speculators]], check=True)
    subprocess.run([str(python), "-c", "import speculators.models.eagle3, speculators.models.mtp"], check=True)
    ready.write_text(stamp)
    return python


if __name__ == "__main__":
    print(speculators_python())
