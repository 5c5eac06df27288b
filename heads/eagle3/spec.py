"""EAGLE-3's catalog entry: its module, options, drafters, export detector, checker and converter."""

from __future__ import annotations

from headstart.heads.eagle3.check import check_eagle3, detect_eagle3, eagle3_trained_depth
from headstart.heads.eagle3.convert import convert_eagle3
from headstart.heads.eagle3.drafter import Eagle3Drafter
from headstart.heads.eagle3.module import Eagle3Draft, Eagle3Options, build_eagle3
from headstart.heads.spec import HeadSpec

EAGLE3 = HeadSpec(
    learns_online=True,
    title="EAGLE-3 head", cls=Eagle3Draft, options=Eagle3Options, build=build_eagle3, drafter=Eagle3Drafter,
    detect=detect_eagle3, check=check_eagle3, convert=convert_eagle3, unit="TTT step k",
    trained_depth=eagle3_trained_depth, tiny={"draft_vocab_size": 64, "ttt_steps": 3},
    cards={"flat": "Flat EAGLE-3 server layout (config.json + model.safetensors with d2t/t2d; no embed_tokens: the "
                   "target's are used).",
           "speculators": "vLLM's speculators layout (`vllm serve` detects it; the config names the target)."})
