"""DSpark's export detector (its ``check_head`` rules are its reader's refusals: heads/dflash/module.py ``load``)."""

from __future__ import annotations

from pathlib import Path

from headstart.heads.dspark.config import DSparkConfig


def detect_dspark(directory: Path, config: dict) -> str | None:
    return "dspark" if (config.get("architectures") or [None])[0] == DSparkConfig.architecture else None
