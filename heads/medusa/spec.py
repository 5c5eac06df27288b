"""Medusa's catalog entry: its module, options, drafters and export detector (its reader checks it)."""

from __future__ import annotations

from headstart.heads.medusa.drafter import MedusaDrafter
from headstart.heads.medusa.module import MedusaHeads, MedusaOptions, build_medusa, detect_medusa
from headstart.heads.spec import HeadSpec

MEDUSA = HeadSpec(
    learns_online=True,
    title="Medusa heads", cls=MedusaHeads, options=MedusaOptions, build=build_medusa, drafter=MedusaDrafter, detect=detect_medusa, unit="head k+1 (predicts token t+k+2)",
    trained_depth=lambda config: config.get("num_heads"),
    cards={"vllm": "vLLM's Medusa layout (config.json with num_heads / num_hidden_layers, blocks.{i}.layers.{j} "
                   "and lm_heads.{i} in model.safetensors)."})
