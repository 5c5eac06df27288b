"""Early exit's catalog entry: its adapter module, options, drafter and export detector (its reader checks it)."""

from __future__ import annotations

from headstart.heads.early_exit.drafter import EarlyExitDrafter
from headstart.heads.early_exit.module import EarlyExitAdapter, EarlyExitOptions, build_early_exit, detect_early_exit
from headstart.heads.spec import HeadSpec

EARLY_EXIT = HeadSpec(
    title="early-exit adapter", cls=EarlyExitAdapter, options=EarlyExitOptions, build=build_early_exit,
    drafter=EarlyExitDrafter, detect=detect_early_exit, unit="next token, from layer E", tiny={"exit_layer": 4},
    cards={"headstart": "headstart's own early-exit layout (config.json `HeadstartEarlyExit` with the exit layer; "
                        "blocks.layers.{j} in model.safetensors; the target's layers, norm and lm_head are not saved). "
                        "No server runs early exit: headstart's decoder does (`--method early-exit`)."})
