"""MTP's catalog entry: its module, options, drafters and export detector (its reader checks it)."""

from __future__ import annotations

from headstart.heads.mtp.checkpoint import detect_mtp
from headstart.heads.mtp.drafter import MTPDrafter
from headstart.heads.mtp.module import MTPHead, MTPOptions, build_mtp_head
from headstart.heads.spec import HeadSpec

MTP = HeadSpec(
    learns_online=True,
    title="MTP layer", cls=MTPHead, options=MTPOptions, build=build_mtp_head, drafter=MTPDrafter, detect=detect_mtp, unit="unrolled step k (predicts token t+k+2)",
    trained_depth=lambda config: config.get("unroll"), tiny={"ttt_steps": 3},
    cards={"headstart": "headstart's own MTP layout for a dense target (config.json + model.safetensors: enorm, "
                        "hnorm, eh_proj, block.*, norm; the target's embedding and lm_head are shared).",
           "deepseek": "DeepSeek-V3's own checkpoint layout: a copy of the target with the trained layer as "
                       "model.layers.{L}.* (what vLLM's and SGLang's MTP loaders read).",
           "qwen3_next": "Qwen3-Next's own checkpoint layout: a copy of the target with the trained layer as mtp.*."})
