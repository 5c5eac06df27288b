"""What a careless user does, command by command: each is refused in one line (``error: ...`` on stderr, exit 2, no
traceback) before any model loads, or works as documented; nothing they had is lost. Every command runs in process
through ``headstart``'s own entry point (scripts/cli.py), on the committed demo target and heads."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from headstart.models import files
from headstart.scripts import benchmark, cli

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo"
TARGET = DEMO / "target"
QUESTIONS = DEMO / "eval" / "mt_bench.jsonl"


def headstart(capsys, monkeypatch, *argv: str | Path) -> tuple[int, str]:
    """``headstart ARGV`` in this process: (exit code, stderr)."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # cli.main sets it for the command's parser
    code = cli.main([str(a) for a in argv])
    return code, capsys.readouterr().err


def refused(code: int, err: str, *named: str | Path) -> str:
    """Exit 2 and one line on stderr, ``error: ...``, naming each of ``named``; returns the line."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    for name in named:
        assert str(name) in lines[0], lines[0]
    assert "Traceback" not in err
    return lines[0]


def copy_head(tmp_path: Path, name: str = "eagle3-head") -> Path:
    head = tmp_path / name
    shutil.copytree(DEMO / name, head)
    return head


def files_of(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def chat_file(tmp_path: Path, text: str | bytes, name: str = "chats.jsonl") -> Path:
    path = tmp_path / name
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


GOOD_ROW = json.dumps({"messages": [{"role": "user", "content": "What is 2 + 2?"},
                                    {"role": "assistant", "content": "It is 4."}]})


# --- commands that could lose work ---------------------------------------------------------------------------------

@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A finished run: its head in final/, its checkpoints and metrics beside."""
    run = tmp_path / "run"
    shutil.copytree(DEMO / "eagle3-head", run / "final")
    (run / "checkpoints" / "step_000010").mkdir(parents=True)
    (run / "checkpoints" / "step_000010" / "trainer_state.json").write_text("{}")
    (run / "metrics.jsonl").write_text('{"split": "train", "step": 1}\n')
    return run


@pytest.mark.parametrize("out", ["run", "run/final", "run/final/inside"])
@pytest.mark.parametrize("flag", ["--force", "--overwrite"])
def test_export_out_is_parent_of_source_refused_and_nothing_deleted(out, flag, run_dir, tmp_path, capsys, monkeypatch):
    before = files_of(run_dir)
    code, err = headstart(capsys, monkeypatch, "export", "--head", run_dir / "final", "--to", "speculators",
                          "--out", tmp_path / out, flag)
    refused(code, err, f"--out {tmp_path / out}", "own input")
    assert files_of(run_dir) == before


def test_export_into_a_used_directory_refused_then_overwrite_moves_it_aside(tmp_path, capsys, monkeypatch):
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    args = ("export", "--head", DEMO / "eagle3-head", "--to", "speculators", "--out", used, "--target", TARGET)
    refused(*headstart(capsys, monkeypatch, *args), f"--out {used} already holds files", "--overwrite")
    assert (used / "notes.txt").read_text() == "mine"
    assert headstart(capsys, monkeypatch, *args, "--overwrite")[0] == 0
    assert (used / "config.json").is_file()
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("used.old-")]
    assert len(aside) == 1 and (aside[0] / "notes.txt").read_text() == "mine"  # moved aside, not deleted


def test_prepare_into_a_used_directory_refused_and_its_files_kept(tmp_path, capsys, monkeypatch):
    out = tmp_path / "tokenized"
    out.mkdir()
    (out / "summary.json").write_text('{"rows_kept": 7}')
    data = chat_file(tmp_path, GOOD_ROW + "\n")
    code, err = headstart(capsys, monkeypatch, "prepare", "--data", data, "--tokenizer", TARGET, "--output", out)
    refused(code, err, f"--output {out} already holds files", "--overwrite")
    assert (out / "summary.json").read_text() == '{"rows_kept": 7}'
    code, _ = headstart(capsys, monkeypatch, "prepare", "--data", data, "--tokenizer", TARGET, "--output", out,
                        "--overwrite")
    assert code == 0 and json.loads((out / "summary.json").read_text())["rows_kept"] == 1
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("tokenized.old-")]
    assert len(aside) == 1 and (aside[0] / "summary.json").read_text() == '{"rows_kept": 7}'


def test_prepare_output_is_the_data_directory_refused_even_with_overwrite(tmp_path, capsys, monkeypatch):
    data = chat_file(tmp_path, GOOD_ROW + "\n")
    code, err = headstart(capsys, monkeypatch, "prepare", "--data", data, "--tokenizer", TARGET, "--output", tmp_path,
                          "--overwrite")
    refused(code, err, f"--output {tmp_path}", "own input")
    assert data.read_text() == GOOD_ROW + "\n"


def test_publish_out_is_the_run_refused_and_nothing_moved(run_dir, capsys, monkeypatch):
    before = files_of(run_dir)
    code, err = headstart(capsys, monkeypatch, "publish", "--run", run_dir, "--out", run_dir, "--overwrite")
    refused(code, err, f"--out {run_dir}", "own input")
    assert files_of(run_dir) == before


def test_publish_into_a_used_directory_refused(run_dir, tmp_path, capsys, monkeypatch):
    used = tmp_path / "published"
    used.mkdir()
    (used / "README.md").write_text("another head's card")
    refused(*headstart(capsys, monkeypatch, "publish", "--run", run_dir, "--out", used), f"--out {used}", "--overwrite")
    assert (used / "README.md").read_text() == "another head's card"


def test_bench_into_a_used_directory_refused_before_the_target_loads(tmp_path, capsys, monkeypatch):
    used = tmp_path / "bench"
    used.mkdir()
    (used / "results.json").write_text("{}")
    code, err = headstart(capsys, monkeypatch, "bench", "--target", TARGET, "--method", "ngram", "--questions", QUESTIONS,
                          "--out", used)
    refused(code, err, f"--out {used} already holds files", "--overwrite")
    assert (used / "results.json").read_text() == "{}"


@pytest.mark.parametrize("key", ["max_steps", "batch_size", "save_every", "log_every"])
def test_train_with_a_zero_step_count_or_batch_refused_by_key(key, tmp_path, capsys, monkeypatch):
    code, err = headstart(capsys, monkeypatch, "train", "--config", DEMO / "eagle3.yaml", f"--train.{key}=0",
                          f"--output_dir={tmp_path / 'run'}")
    refused(code, err, f"train.{key}=0: must be >= 1")
    assert not (tmp_path / "run").exists()


def test_train_init_from_another_targets_head_names_the_recipe_key_not_a_flag(tmp_path, capsys, monkeypatch):
    head = other_target_head(tmp_path)
    code, err = headstart(capsys, monkeypatch, "train", "--config", DEMO / "eagle3.yaml", f"--draft.init_from={head}",
                          f"--output_dir={tmp_path / 'run'}")
    line = refused(code, err, "draft.init_from", "was trained against")
    assert "--allow-other-target" not in line


# --- bench and generate: numbers and files checked before the target loads -------------------------------------------

BENCH = ("bench", "--target", TARGET, "--method", "eagle3", "--questions", QUESTIONS, "--max-new-tokens", "8",
         "--limit", "1", "--no-hf-reference")
GENERATE = ("generate", "--target", TARGET, "--method", "eagle3", "--prompt", "Hi", "--max-new-tokens", "8")


def command(name: str, tmp_path: Path, draft: Path | str = DEMO / "eagle3-head", method: str = "eagle3") -> list:
    argv = list(BENCH if name == "bench" else GENERATE) + ["--draft", draft]
    argv[argv.index("--method") + 1] = method
    return argv + (["--out", tmp_path / "out"] if name == "bench" else [])


@pytest.mark.parametrize("k", ["-1", "0"])
def test_bench_with_fewer_than_one_speculative_token_refused(k, tmp_path, capsys, monkeypatch):
    code, err = headstart(capsys, monkeypatch, *command("bench", tmp_path), "--num-speculative-tokens", k)
    refused(code, err, f"--num-speculative-tokens {k}: must be >= 1")
    assert not (tmp_path / "out").exists()


def test_bench_with_more_speculative_tokens_than_the_head_was_trained_for_warns(capsys):
    p = benchmark.build_parser()
    args = p.parse_args([str(a) for a in BENCH[1:]] + ["--draft", str(DEMO / "eagle3-head"), "--out", "unused",
                                                      "--num-speculative-tokens", "1000"])
    benchmark.check_args(p, args)
    benchmark.check_inputs(args)
    err = capsys.readouterr().err
    assert "warning: --num-speculative-tokens 1000 is more than the 4 drafts per round" in err


@pytest.mark.parametrize("name", ["bench", "generate"])
def test_negative_temperature_refused(name, tmp_path, capsys, monkeypatch):
    code, err = headstart(capsys, monkeypatch, *command(name, tmp_path), "--temperature", "-1")
    refused(code, err, "--temperature -1.0: must be >= 0")


def truncated(tmp_path: Path) -> Path:
    head = copy_head(tmp_path)
    weights = head / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return head


def without_config(tmp_path: Path) -> Path:
    head = copy_head(tmp_path)
    (head / "config.json").unlink()
    return head


def broken_config(tmp_path: Path) -> Path:
    head = copy_head(tmp_path)
    (head / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"], ')
    return head


def other_target_head(tmp_path: Path) -> Path:
    head = copy_head(tmp_path)
    record = json.loads((head / "headstart.json").read_text())
    record["target"]["name_or_path"] = "/models/another-target"
    record["target"]["config"]["hidden_size"] = 4096
    record["target"]["config_sha256"] = "0" * 16
    (head / "headstart.json").write_text(json.dumps(record))
    return head


BROKEN_HEADS = {  # what the user gave as --draft -> what the one line names
    "truncated_weights": (truncated, "model.safetensors: cut short"),
    "head_without_config_json": (without_config, "no config.json"),
    "head_with_a_broken_config_json": (broken_config, "config.json: not valid JSON"),
    "another_targets_head": (other_target_head, "was trained against /models/another-target"),
}


@pytest.mark.parametrize("name", ["bench", "generate"])
@pytest.mark.parametrize("case", sorted(BROKEN_HEADS))
def test_broken_or_foreign_head_refused_in_one_line(case, name, tmp_path, capsys, monkeypatch):
    make, named = BROKEN_HEADS[case]
    code, err = headstart(capsys, monkeypatch, *command(name, tmp_path, make(tmp_path)))
    refused(code, err, named)


@pytest.mark.parametrize("name", ["bench", "generate"])
def test_eagle3_head_given_to_method_medusa_refused_with_the_right_method(name, tmp_path, capsys, monkeypatch):
    code, err = headstart(capsys, monkeypatch, *command(name, tmp_path, method="medusa"))
    refused(code, err, "eagle3-head holds eagle3", "--method eagle3")


QUESTION_FILES = {  # the questions file -> what the one line says
    "empty": ("", "no questions (the file is empty)"),
    "a_json_list": (json.dumps([{"turns": ["Hi"]}]), "line 1: expected 'turns': [str, ...] in one JSON object a line"),
    "a_broken_line": ('{"turns": ["Hi"]}\n{"turns": [\n', "line 2: not JSON"),
    "turns_not_a_list": ('{"turns": "Hi"}\n', "line 1: expected 'turns': [str, ...] in one JSON object a line"),
}


@pytest.mark.parametrize("case", sorted(QUESTION_FILES))
def test_bench_with_a_bad_questions_file_refused_by_file_and_line(case, tmp_path, capsys, monkeypatch):
    text, named = QUESTION_FILES[case]
    questions = tmp_path / "q.jsonl"
    questions.write_text(text)
    argv = command("bench", tmp_path)
    argv[argv.index("--questions") + 1] = questions
    refused(*headstart(capsys, monkeypatch, *argv), questions, named)


def test_export_of_a_truncated_head_refused(tmp_path, capsys, monkeypatch):
    code, err = headstart(capsys, monkeypatch, "export", "--head", truncated(tmp_path), "--to", "speculators",
                          "--out", tmp_path / "out", "--target", TARGET)
    refused(code, err, "model.safetensors: cut short")
    assert not (tmp_path / "out").exists()


# --- prepare: the tokenizer, the output and the data files ---------------------------------------------------------

def test_prepare_with_a_missing_tokenizer_refused(tmp_path, capsys, monkeypatch):
    data = chat_file(tmp_path, GOOD_ROW + "\n")
    code, err = headstart(capsys, monkeypatch, "prepare", "--data", data, "--tokenizer", tmp_path / "nope",
                          "--output", tmp_path / "out")
    refused(code, err, f"--tokenizer {tmp_path / 'nope'}: no such directory")


def test_prepare_output_is_a_file_refused(tmp_path, capsys, monkeypatch):
    data = chat_file(tmp_path, GOOD_ROW + "\n")
    out = chat_file(tmp_path, "not a directory", "out.txt")
    code, err = headstart(capsys, monkeypatch, "prepare", "--data", data, "--tokenizer", TARGET, "--output", out)
    refused(code, err, f"--output {out} is a file")
    assert out.read_text() == "not a directory"


DATA_FILES = {  # the data file's bytes -> what the one line says
    "empty": (b"", "the file is empty"),
    "a_malformed_jsonl_line": ((GOOD_ROW + "\n" + '{"messages": [oops\n').encode(), "line 2: not valid JSON"),
    "non_utf8_bytes": (GOOD_ROW.replace("4.", "4\xff").encode("latin-1") + b"\n", "line 1: not UTF-8 text"),
}


@pytest.mark.parametrize("case", sorted(DATA_FILES))
def test_prepare_with_a_bad_data_file_refused_by_file_and_line(case, tmp_path, capsys, monkeypatch):
    content, named = DATA_FILES[case]
    data = chat_file(tmp_path, content)
    code, err = headstart(capsys, monkeypatch, "prepare", "--data", data, "--tokenizer", TARGET,
                          "--output", tmp_path / "out")
    refused(code, err, data, named)


def test_prepare_with_a_directory_as_the_data_file_says_so(tmp_path, capsys, monkeypatch):
    (tmp_path / "data").mkdir()
    code, err = headstart(capsys, monkeypatch, "prepare", "--data", tmp_path / "data", "--tokenizer", TARGET,
                          "--output", tmp_path / "out")
    refused(code, err, f"data file {tmp_path / 'data'} is a directory")


def test_check_of_a_head_without_config_json_says_which_file_is_missing(tmp_path, capsys, monkeypatch):
    code = cli.main(["check", "--head", str(without_config(tmp_path)), "--target", str(TARGET)])
    out = capsys.readouterr().out
    assert code == 1 and "no config.json" in out and "not a head headstart can read" not in out


# --- permissions, and what a bug looks like --------------------------------------------------------------------------

@pytest.fixture(params=[0o022, 0o027])
def umask(request):
    old = os.umask(request.param)
    files.umask.cache_clear()
    yield request.param
    os.umask(old)
    files.umask.cache_clear()


def test_exported_head_and_feature_shard_get_the_umask_mode(umask, tmp_path, capsys, monkeypatch):
    from headstart.trainer.feature_store import write_shard

    assert headstart(capsys, monkeypatch, "export", "--head", DEMO / "eagle3-head", "--to", "speculators",
                     "--out", tmp_path / "spec", "--target", TARGET)[0] == 0
    write_shard(tmp_path, "shard-r000-00000", [0], [{"input_ids": torch.arange(4)}])
    for path in [tmp_path / "spec" / "model.safetensors", tmp_path / "spec" / "config.json",
                 tmp_path / "shard-r000-00000.safetensors"]:
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, path


def test_the_umask_mode_leaves_a_linked_targets_files_alone(umask, tmp_path):
    shard = tmp_path / "target-shard.safetensors"
    shard.write_bytes(b"x")
    os.chmod(shard, 0o600)
    (tmp_path / "out").mkdir()
    os.symlink(shard, tmp_path / "out" / "model-base.safetensors")  # as an MTP export links its target's shards
    (tmp_path / "out" / "model-mtp.safetensors").write_bytes(b"y")
    files.share_like_umask(tmp_path / "out")
    assert shard.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "out" / "model-mtp.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_bug_prints_its_traceback_and_says_so(capsys, monkeypatch):
    from headstart.scripts import plan

    def broken(argv=None):
        raise KeyError("a bug")

    monkeypatch.setattr(plan, "main", broken)
    code, err = headstart(capsys, monkeypatch, "plan", "--config", "x.yaml")
    assert code == 1 and "Traceback" in err and "KeyError" in err and "bug in headstart" in err.splitlines()[-1]
