"""DFlash's catalog entry: its module, options, drafter and export detector."""

from __future__ import annotations

from headstart.heads.dflash.check import detect_dflash
from headstart.heads.dflash.config import DFlashOptions
from headstart.heads.dflash.drafter import DFlashDrafter
from headstart.heads.dflash.module import DFlashDraft, build_dflash
from headstart.heads.spec import HeadSpec

DFLASH = HeadSpec(
    learns_online=True,
    title="DFlash head", cls=DFlashDraft, options=DFlashOptions, build=build_dflash, drafter=DFlashDrafter,
    detect=detect_dflash, unit="block slot k+1", tiny={"block_size": 4, "anchors": 1000},
    trained_depth=lambda config: config["block_size"] - 1 if config.get("block_size") else None,
    cards={"dflash": "z-lab's DFlash layout (config.json with `dflash_config` + model.safetensors, no embedding or "
                     "lm_head: the target's are used): vLLM (`\"method\": \"dflash\"`) and SGLang "
                     "(`--speculative-algorithm DFLASH`) load it."})
