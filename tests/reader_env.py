"""A cached virtual environment for a package that reads headstart's exports the way a server does (vLLM's
``speculators``, z-lab's ``dflash``), where its pins clash with headstart's.

Built once per requirements file under ``$HEADSTART_READER_VENVS`` (default ``~/.cache/headstart``): the same torch as
this environment (``torch==<this version>``; on CI's machine a CPU build from disk), then the packages named
``no_deps`` without their dependencies (pins this machine cannot or need not meet), then the rest of the file. Rebuilt
when torch or the file changes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch


def reader_python(name: str, requirements: Path, no_deps: tuple[str, ...], check: str) -> Path:
    """The venv ``name``'s python, building it first if it is not complete; ``check``: Python its packages must import."""
    root = Path(os.environ.get("HEADSTART_READER_VENVS", Path.home() / ".cache" / "headstart")) / name
    python, ready = root / "bin" / "python", root / ".headstart-ready"
    stamp = f"torch=={torch.__version__}\n{requirements.read_text()}"
    if ready.is_file() and ready.read_text() == stamp:
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(root)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    lines = [x.split("#")[0].strip() for x in requirements.read_text().splitlines()]
    lines = [x for x in lines if x]
    alone = [x for x in lines if x.split("=")[0] in no_deps]
    subprocess.run([*pip, f"torch=={torch.__version__.split('+')[0]}"], check=True)
    subprocess.run([*pip, "--no-deps", *alone], check=True)
    subprocess.run([*pip, *[x for x in lines if x not in alone]], check=True)
    subprocess.run([str(python), "-c", check], check=True)
    ready.write_text(stamp)
    return python
