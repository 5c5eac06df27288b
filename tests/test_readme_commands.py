"""Every headstart command in README.md runs as written: each one's flags are its script's (parsed by the script's own
parser, and a recipe's --section.key=value overrides by the recipe loader), and, nightly, the demo commands run."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from headstart.scripts import cli
from headstart.trainer.config import load_config

REPO = Path(__file__).resolve().parents[1]


def readme_commands() -> list[list[str]]:
    """The README's shell commands, continuation lines joined, comments dropped, `a && b` and `a &` split."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            current: list[str] = []
            for word in words + ["&&"]:
                if word in ("&&", "&"):
                    if current:
                        commands.append(current)
                    current = []
                else:
                    current.append(word)
    return commands


def script_and_args(words: list[str]) -> tuple[str, list[str]] | None:
    """(module of headstart.scripts, its arguments) for a headstart command; None for pip, vllm, pytest..."""
    if words[0] == "headstart":
        return cli.COMMANDS[words[1]][0], words[2:]
    for i, word in enumerate(words):
        if word.startswith("scripts/") and word.endswith(".py") and words[0] in ("python", "torchrun"):
            return Path(word).stem, words[i + 1:]
    return None


class Parsed(Exception):
    pass


def parse_only(module: str, args: list[str], monkeypatch) -> argparse.Namespace:
    """Run the script's main up to its parser: the parsed flags, or the parser's own error (SystemExit)."""
    for name in ("parse_args", "parse_known_args"):
        original = getattr(argparse.ArgumentParser, name)

        def stop(self, *a, _original=original, **k):
            raise Parsed(_original(self, *a, **k))

        monkeypatch.setattr(argparse.ArgumentParser, name, stop)
    with pytest.raises(Parsed) as parsed:
        importlib.import_module(f"headstart.scripts.{module}").main(args)
    result = parsed.value.args[0]
    return result[0] if isinstance(result, tuple) else result


def test_readme_has_the_commands_a_user_runs():
    scripts = {found[0] for words in readme_commands() if (found := script_and_args(words))}
    assert {"train_eagle3", "prepare_data", "regenerate_data", "check_head", "benchmark", "generate"} <= scripts


@pytest.mark.parametrize("words", [w for w in readme_commands() if script_and_args(w)], ids=lambda w: " ".join(w)[:60])
def test_each_readme_command_parses_as_written(words, monkeypatch):
    monkeypatch.chdir(REPO)
    module, args = script_and_args(words)
    parsed = parse_only(module, args, monkeypatch)
    if module == "train_eagle3":  # the recipe takes the rest: every override must be one of its fields
        overrides = [a for a in args if a.startswith("--") and "=" in a]  # the recipe's --section.key=value
        config = load_config(parsed.config, overrides)
        assert Path(parsed.config).is_file() and config.output_dir


@pytest.mark.nightly  # the main job, then the demo commands after it, as a user runs them: ~10 min on 2 cores
def test_the_demo_commands_run_as_written(tmp_path):
    for name in ("configs", "scripts"):
        (tmp_path / name).symlink_to(REPO / name)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    demo = [w for w in readme_commands() if "configs/demo/target" in w or "configs/demo/eagle3.yaml" in w]
    assert demo[0][:2] == ["headstart", "train"] and len(demo) >= 4
    for words in demo:
        words = [sys.executable, "-m", "torch.distributed.run", *words[1:]] if words[0] == "torchrun" else (
            [sys.executable, "-m", "headstart.scripts.cli", *words[1:]] if words[0] == "headstart" else words)
        done = subprocess.run(words, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
        assert done.returncode == 0, (words, done.stdout[-2000:], done.stderr[-3000:])
    assert (tmp_path / "runs" / "bench-eagle3" / "results.json").is_file()
    again = subprocess.run([sys.executable, "-m", "headstart.scripts.cli", *demo[0][1:]], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600)  # the main job again: refused, alone
    assert again.returncode == 2 and again.stdout == ""
    assert again.stderr.strip().splitlines()[-1].startswith("error: runs/demo-eagle3 already holds a training run")
    assert "Traceback" not in again.stderr and "ChildFailedError" not in again.stderr
