"""DFlash2's export detector (its ``check_head`` rules are its reader's refusals: heads/dflash/module.py ``load``)."""

from __future__ import annotations

from pathlib import Path

from headstart.heads.dflash2.config import DFlash2Config


def detect_dflash2(directory: Path, config: dict) -> str | None:
    return "dflash2" if (config.get("architectures") or [None])[0] == DFlash2Config.architecture else None
