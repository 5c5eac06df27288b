"""The committed recipes: every one loads, every data file it names that the repo ships is readable in the rows it
names, and no SmolLM2 recipe trains on the held-out questions (configs/smollm2/data/heldout_questions.jsonl)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from headstart.trainer.config import load_config
from headstart.trainer.conversations import detect_format, to_messages
from headstart.trainer.data import read_rows, split_rows

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "configs").rglob("*.yaml"))
DEMO_FILES = ["gsm8k_train.jsonl", "gpteacher_codegen.json", "gpteacher_roleplay.json", "gpteacher_toolformer.json"]


def first_user_turns(path: str) -> set[str]:
    rows = read_rows(path)
    fmt = detect_format(rows[0])
    return {next(m["content"] for m in to_messages(row, fmt) if m["role"] == "user") for row in rows}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(REPO)))
def test_recipe_loads_and_its_shipped_data_is_readable(recipe, monkeypatch):
    monkeypatch.chdir(REPO)
    config = load_config(str(recipe))
    assert config.data.files, recipe
    start_from = config.draft.init_from  # a published head, shipped or made by a command in the recipe's header
    if start_from is not None:
        assert Path(start_from, "config.json").is_file() or f"--out {start_from}" in recipe.read_text(), recipe
    for path in config.data.files:
        file, start, stop = split_rows(path)
        if not Path(file).is_file():  # made by a step the recipe names (regeneration); nothing to read here
            assert file.startswith("runs/") or "regenerat" in recipe.read_text(), (recipe, file)
            continue
        rows = read_rows(path)
        assert len(rows) == (stop or len(read_rows(file))) - start, path


@pytest.mark.parametrize("name, rows", [("heldout_questions.jsonl", "250:254"), ("tuning_questions.jsonl", "1004:1008")])
def test_no_smollm2_recipe_trains_on_the_held_out_questions(monkeypatch, name, rows):
    """Neither the held-out questions (measuring heads) nor the tuning ones (choosing a tree shape, so that the held-out
    ones measure the choice) are in any SmolLM2 recipe's data."""
    monkeypatch.chdir(REPO)
    held_out = [json.loads(line)["turns"][0] for line in open(f"configs/smollm2/data/{name}")]
    assert len(held_out) == 16
    # The matching itself: the 16 are the first user turns of these rows of the four demo files.
    assert set(held_out) == set().union(*(first_user_turns(f"configs/demo/data/{f}[{rows}]") for f in DEMO_FILES))
    # ...and they survive regeneration: the regenerated rows' questions are the demo files' first 250 rows'.
    regenerated = first_user_turns("configs/smollm2/data/regenerated.jsonl")
    assert len(regenerated & first_user_turns(f"configs/demo/data/{DEMO_FILES[0]}[:250]")) > 200
    for recipe in sorted((REPO / "configs" / "smollm2").glob("*.yaml")):
        for path in load_config(str(recipe)).data.files:
            if Path(split_rows(path)[0]).is_file():
                assert not set(held_out) & first_user_turns(path), (recipe, path)
