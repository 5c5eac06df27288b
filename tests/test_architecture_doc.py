"""docs/ARCHITECTURE.md true to the code: every file and folder it names exists, the catalog it shows is the
registry's, and its table of a head's entry lists exactly HeadSpec's fields."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from headstart.heads.spec import HeadSpec

REPO = Path(__file__).resolve().parents[1]
DOC = (REPO / "docs" / "ARCHITECTURE.md").read_text()


def test_every_path_the_page_names_exists():
    paths = set(re.findall(r"`((?:models|decode|heads|trainer|scripts|benchmarks|tests|docs|configs)/[\w./<>-]*)`", DOC))
    paths |= {f"heads/eagle3/{name}" for name in re.findall(r"^  (\w+\.py) ", DOC, re.M)}  # the folder listing
    missing = sorted(p for p in paths if "<" not in p and not (REPO / p.split(" ")[0]).exists())
    assert paths and missing == [], missing


def test_the_catalog_shown_is_the_registry_s():
    shown = re.search(r"```python\n(HEADS: dict\[str, HeadSpec\] = \{.*?\})\n```", DOC, re.S).group(1)
    source = (REPO / "heads" / "registry.py").read_text()
    assert shown in source


def test_the_entry_table_lists_every_field_of_headspec():
    rows = re.findall(r"^\| (`[^|]+`) \|", DOC, re.M)
    named = {n for row in rows for n in re.findall(r"`(\w+)`", row)} - {"field"}
    assert named == {f.name for f in dataclasses.fields(HeadSpec)}
