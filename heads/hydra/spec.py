"""Hydra's catalog entry: its module, options, drafter and export detector (its reader checks it)."""

from __future__ import annotations

from headstart.heads.hydra.drafter import HydraDrafter
from headstart.heads.hydra.module import HydraHeads, HydraOptions, build_hydra, detect_hydra
from headstart.heads.spec import HeadSpec

HYDRA = HeadSpec(
    learns_online=True,
    title="Hydra heads", cls=HydraHeads, options=HydraOptions, build=build_hydra, drafter=HydraDrafter,
    detect=detect_hydra, unit="head k+1 (predicts token t+k+2)", trained_depth=lambda config: config.get("num_heads"),
    cards={"hydra": "headstart's own Hydra layout (config.json `HydraModel`; heads.{s}.proj, heads.{s}.block.layers.{j}, "
                    "heads.{s}.lm_head in model.safetensors; the target's embedding is not saved). No server loads it: "
                    "headstart's decoder runs it."})
