"""DFlash's export detector (its ``check_head`` rules are its reader's refusals: heads/dflash/module.py ``load``)."""

from __future__ import annotations

from pathlib import Path

from headstart.heads.dflash.config import ARCHITECTURE


def detect_dflash(directory: Path, config: dict) -> str | None:
    return "dflash" if (config.get("architectures") or [None])[0] == ARCHITECTURE else None
