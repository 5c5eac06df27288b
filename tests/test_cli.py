"""The ``headstart`` command: every subcommand reaches its script's parser, and the training module runs under -m."""

from __future__ import annotations

import subprocess
import sys

import pytest

from headstart.scripts import cli


def test_usage_lists_every_command(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert f"\n  {name} " in out
    # one whole line per command: no reST markup, no sentence cut short, nothing wider than a terminal
    assert "``" not in out and all(len(line) <= 100 for line in out.splitlines())
    assert all(line.rstrip()[-1] not in "(,:" for line in out.splitlines() if line.startswith("  "))
    assert cli.main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_each_command_has_its_scripts_flags(name, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main([name, "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: headstart {name} ")
    # A flag every one of these scripts defines for itself, proving the call reached the right parser.
    flags = {"prepare": "--tokenizer", "regenerate": "--max-new-tokens", "features": "--config", "train": "--resume",
             "export": "--to", "publish": "--run", "check": "--head", "bench": "--method", "evaluate": "--head",
             "medusa-tree": "--nodes", "draft-config": "--target", "import-gguf": "--package", "adapt": "--log",
             "generate": "--prompt-file", "plan": "--gpu-memory", "datastore": "--output", "layer-skip": "--skip"}
    assert flags[name] in out


@pytest.mark.slow  # 27 s here: with CI's slow tests, out of the default suite's ten minutes
def test_console_script_and_module_entry_points():
    out = subprocess.run(["headstart", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "import-gguf" in out.stdout
    out = subprocess.run([sys.executable, "-m", "headstart.train", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--resume" in out.stdout and "--overwrite" in out.stdout
    out = subprocess.run(["headstart", "check", "--head", "/nonexistent/head", "--target", "/nonexistent/target"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "/nonexistent" in out.stdout + out.stderr
