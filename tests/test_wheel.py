"""The project installed as a user installs it: from its wheel, into a fresh virtual environment, run from outside
the checkout. An editable install hides a package the wheel leaves out; this test does not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def code_files() -> set[str]:
    """The package's modules as the wheel should hold them: every tracked .py outside the tests, recipes and docs
    (and the build script), under ``headstart/``."""
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return {f"headstart/{p}" for p in tracked.split() if p.split("/")[0] not in ("tests", "configs", "docs")
            and p != "setup.py"}


@pytest.mark.slow  # builds and installs a wheel: about a minute here
def test_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    if not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout (the tracked files are what the wheel must hold)")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT),
                    "-w", str(tmp_path / "dist")], check=True, cwd=tmp_path)
    wheel = next((tmp_path / "dist").glob("headstart-*.whl"))
    inside = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    assert code_files() - inside == set(), "modules the wheel leaves out"
    assert inside - code_files() == set(), "files in the wheel that are not the package's code"

    # The dependencies come from this interpreter's site-packages; headstart only from the wheel (--no-deps).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)], check=True)
    env = {**os.environ, "PYTHONPATH": "", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    away = tmp_path / "elsewhere"
    away.mkdir()

    where = subprocess.run([python, "-c", "import headstart.heads.registry, headstart; print(headstart.__file__)"],
                           cwd=away, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert where.startswith(str(venv)), f"headstart imported from {where}, not the installed wheel"

    headstart = venv / "bin" / "headstart"
    help_text = subprocess.run([headstart, "--help"], cwd=away, env=env, capture_output=True, text=True, check=True).stdout
    assert "bench" in help_text and "train" in help_text

    demo = ROOT / "configs" / "demo"
    bench = subprocess.run([headstart, "bench", "--target", demo / "target", "--method", "eagle3",
                            "--draft", demo / "eagle3-head", "--questions", demo / "eval" / "mt_bench.jsonl",
                            "--limit", "1", "--max-new-tokens", "16", "--no-hf-reference", "--verify-greedy",
                            "--out", away / "bench"], cwd=away, env=env, capture_output=True, text=True)
    assert bench.returncode == 0, bench.stderr[-3000:]
    results = json.loads((away / "bench" / "results.json").read_text())
    assert results["results"]["overall"]["tau"] > 1.0  # the committed head accepts drafts on the demo target
