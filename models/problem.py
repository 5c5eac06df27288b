"""One thing wrong with an exported head, naming the file and key (what ``check_head`` reports), and the tensor
listing its rules read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open


@dataclass(frozen=True)
class Problem:
    file: str
    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}: {self.key}: " + " ".join(self.message.split())  # one line per problem


def tensor_meta(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
