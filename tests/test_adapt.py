"""``headstart adapt``: a trained head fine-tuned on a server's request log (OpenAI chat completions) from its export,
with original data replayed, checked at the end; a log, head or recipe that does not fit is refused by name before
anything trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import tiny_causal_lm
from trainer_fixtures import make_setup

from headstart.decode.questions import prompt_ids
from headstart.heads.registry import HEADS, build_head
from headstart.models.export import export_head
from headstart.models.head import DraftConfig
from headstart.models.provenance import fingerprint
from headstart.models.target import Target, TargetConfig, load_tokenizer
from headstart.scripts import adapt, train_eagle3
from headstart.trainer.request_log import LogError, served_conversations

PROMPTS = ["What is 5+6?", "Name a fruit.", "Say goodbye.", "Count to four."]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A tiny EAGLE-3 run (its final/ export and run_config.json) on a tiny target with a chat template."""
    root = tmp_path_factory.mktemp("adapt")
    assert train_eagle3.main(make_setup(root, rows=24)) == 0
    return root


def completion(messages: list[dict], reply: str, tokenizer=None, prompt_ids_of=None) -> dict:
    """One served OpenAI chat completion, with vLLM's prompt token ids where a tokenizer is given."""
    response = {"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]}
    if tokenizer is not None:
        response["prompt_token_ids"] = prompt_ids_of or prompt_ids(tokenizer, messages)[0].tolist()
    return {"request": {"model": "served", "messages": messages}, "response": response}


def write_log(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def served_log(root: Path, n: int = 16) -> Path:
    tokenizer = load_tokenizer(str(root / "target"))
    rows = [completion([{"role": "user", "content": f"{PROMPTS[i % 4]} ({i})"}], f"Served reply {i}: fine.", tokenizer)
            for i in range(n)]
    return write_log(root / f"log-{n}.jsonl", rows)


def test_adapt_fine_tunes_the_export_on_the_log_and_checks_it(trained, tmp_path, capsys):
    log = served_log(trained)
    head = trained / "run" / "final"
    out = tmp_path / "adapted"
    assert adapt.main(["--head", str(head), "--target", str(trained / "target"), "--log", str(log), "--output", str(out),
                       "--steps", "3", "--replay-share", "0.5", "--train.lr=1e-4", "--train.save_every=3"]) == 0
    said = capsys.readouterr().out
    assert "16 served conversations" in said and "16 replayed" in said and "ok: no problems found" in said
    served = [json.loads(x) for x in (out / "data" / "served.jsonl").read_text().splitlines()]
    assert len(served) == 16 and served[3]["messages"][-1] == {"role": "assistant", "content": "Served reply 3: fine."}
    assert len((out / "data" / "replayed.jsonl").read_text().splitlines()) == 16
    before, after = load_file(head / "model.safetensors"), load_file(out / "run" / "final" / "model.safetensors")
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert moved  # it trained ...
    for k in moved:  # ... from the export: 3 small steps away from it
        assert (after[k] - before[k]).abs().max() < 0.05 * before[k].abs().max() + 1e-2, k
    run_config = json.loads((out / "run" / "run_config.json").read_text())
    assert run_config["draft"]["init_from"] == str(head) and run_config["train"]["max_steps"] == 3
    again = ["--head", str(head), "--target", str(trained / "target"), "--log", str(log), "--output", str(out), "--steps", "1"]
    assert adapt.main(again) == 2 and "already holds a training run" in capsys.readouterr().err  # nothing lost
    assert adapt.main([*again, "--overwrite"]) == 0 and list(out.glob("run.old-*"))  # the first run moved aside


def test_from_scratch_trains_a_fresh_head_on_the_same_data(trained, tmp_path):
    out = tmp_path / "scratch"
    assert adapt.main(["--head", str(trained / "run" / "final"), "--target", str(trained / "target"), "--log",
                       str(served_log(trained, 8)), "--output", str(out), "--steps", "2", "--from-scratch",
                       "--replay-share", "0"]) == 0
    assert json.loads((out / "run" / "run_config.json").read_text())["draft"]["init_from"] is None
    assert not (out / "data" / "replayed.jsonl").exists()


def test_a_log_served_under_another_chat_template_is_refused_by_line(trained):
    tokenizer = load_tokenizer(str(trained / "target"))
    messages = [{"role": "user", "content": "Say hello."}]
    ok = completion(messages, "Hello!", tokenizer)
    other = completion(messages, "Hello!", tokenizer, prompt_ids_of=tokenizer("<s>[INST] Say hello. [/INST]")["input_ids"])
    log = write_log(trained / "other-template.jsonl", [ok, other])
    with pytest.raises(LogError, match=r"line 2: the served prompt's token ids differ .* another tokenizer or chat template"):
        served_conversations(log, tokenizer)


@pytest.mark.parametrize("line, refused", [
    ("not json", "line 1: not JSON"),
    ('{"prompt": "hi"}', "line 1: neither an OpenAI chat completion"),
    ('{"request": {"messages": [{"role": "user", "content": "hi"}]}, "response": {"choices": []}}', "no served reply"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "ends with the served assistant reply"),
])
def test_a_malformed_log_line_is_refused_with_its_number(trained, line, refused):
    log = trained / "bad.jsonl"
    log.write_text(line + "\n")
    with pytest.raises(LogError, match=refused):
        served_conversations(log, load_tokenizer(str(trained / "target")))


def test_a_head_for_another_target_or_of_another_kind_is_refused_before_training(trained, tmp_path, capsys):
    other = tmp_path / "other-target"
    model = tiny_causal_lm("llama", num_hidden_layers=8, vocab_size=json.loads(
        (trained / "target" / "config.json").read_text())["vocab_size"], intermediate_size=48)
    model.save_pretrained(other)
    load_tokenizer(str(trained / "target")).save_pretrained(other)
    log = served_log(trained, 4)
    base = ["--head", str(trained / "run" / "final"), "--log", str(log), "--steps", "1"]
    assert adapt.main([*base, "--target", str(other), "--output", str(tmp_path / "a")]) == 2
    assert "trained for" in capsys.readouterr().err and not (tmp_path / "a").exists()
    assert adapt.main([*base, "--target", str(trained / "target"), "--output", str(tmp_path / "b"),
                       "--recipe", str(write_recipe(tmp_path, "medusa"))]) == 2
    assert "trains a medusa head" in capsys.readouterr().err


def test_a_head_that_cannot_learn_from_served_replies_is_refused_by_name(trained, tmp_path, capsys):
    target = Target.from_pretrained(TargetConfig(path=str(trained / "target"), dtype="float32"))
    spec = HEADS["early-exit"]
    head = build_head(DraftConfig(head="early-exit", options=spec.options(**spec.tiny)), target,
                      torch.ones(target.vocab_size))
    export_head(head, tmp_path / "early-exit", "early-exit", fingerprint(str(trained / "target")))
    assert adapt.main(["--head", str(tmp_path / "early-exit"), "--target", str(trained / "target"), "--log",
                       str(served_log(trained, 4)), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "an export of a early-exit adapter" in err and "cannot adapt to a log" in err and "eagle3" in err


def write_recipe(root: Path, head: str) -> Path:
    path = root / f"{head}.yaml"
    path.write_text(f"draft:\n  head: {head}\n")
    return path
