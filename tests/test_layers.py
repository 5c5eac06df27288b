"""The repository keeps its layers (tests/layering.py): models < decode < heads < trainer < scripts, benchmarks; no
import circle; no import inside a function; no private name across files; no head named in models/, decode/ or
trainer/. The checker itself is tested on small trees that break each rule, so that a green run means something."""

from __future__ import annotations

from pathlib import Path

import pytest
from layering import problems

REPO = Path(__file__).resolve().parents[1]


def test_the_repository_keeps_its_layers():
    assert problems(REPO) == []


def tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for top in ("models", "decode", "heads", "trainer"):
        (tmp_path / top).mkdir(exist_ok=True)
        (tmp_path / top / "__init__.py").touch()
    return tmp_path


@pytest.mark.parametrize("files, expected", [
    ({"decode/loop.py": "from headstart.heads.registry import HEADS\n"},
     "decode/loop.py:1: decode/ imports headstart.heads.registry (heads/ is above it)"),
    ({"models/a.py": "def f():\n    from headstart.models.b import g\n", "models/b.py": "g = 1\n"},
     "models/a.py:2: imports headstart.models.b inside a function"),
    ({"trainer/a.py": "from headstart.trainer.b import _hidden\n", "trainer/b.py": "_hidden = 1\n"},
     "trainer/a.py:1: imports the private name _hidden from headstart.trainer.b"),
    ({"trainer/loop.py": "if name == 'medusa':\n    pass\n"},
     "trainer/loop.py:1: names the head 'medusa' (it belongs in heads/)"),
    ({"models/a.py": "from headstart.models import b\n", "models/b.py": "from .a import x\n"},
     "import circle: models/a.py -> models/b.py"),
    ({"heads/x/__init__.py": "", "heads/x/a.py": "from . import b\n", "heads/x/b.py": "from headstart.heads.x.c import y\n",
      "heads/x/c.py": "from headstart.heads.x.a import z\n"},
     "import circle: heads/x/a.py -> heads/x/b.py -> heads/x/c.py"),
])
def test_each_rule_is_found(tmp_path, files, expected):
    assert expected in problems(tree(tmp_path, files))


def test_a_clean_tree_has_no_problem(tmp_path):
    root = tree(tmp_path, {"models/a.py": "import torch\n", "decode/b.py": "from headstart.models.a import torch\n",
                           "heads/h/__init__.py": "", "heads/h/spec.py": "from headstart.decode.b import torch\nNAME = 'medusa'\n",
                           "trainer/c.py": "from headstart.heads.h.spec import NAME\n"})
    assert problems(root) == []
