"""DFlash2's catalog entry: its module, options, drafter and export detector."""

from __future__ import annotations

from headstart.heads.dflash2.check import detect_dflash2
from headstart.heads.dflash2.config import DFlash2Options
from headstart.heads.dflash2.drafter import DFlash2Drafter
from headstart.heads.dflash2.module import DFlash2Draft, build_dflash2
from headstart.heads.spec import HeadSpec

DFLASH2 = HeadSpec(
    learns_online=True,
    title="DFlash2 head", cls=DFlash2Draft, options=DFlash2Options, build=build_dflash2, drafter=DFlash2Drafter,
    detect=detect_dflash2, unit="block slot k+1",
    # selector_top_k beyond a tiny target's vocab: every token a candidate, so the selector's term counts every block
    # from the first step (with a top k, a block counts once the target's token enters it: the loss rises as it learns)
    tiny={"block_size": 4, "anchors": 1000, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 1000},
    trained_depth=lambda config: config["block_size"] - 1 if config.get("block_size") else None,
    cards={"dflash2": "z-lab's DFlash2 layout (config.json `DFlash2DraftModel` with the convolution and selector fields "
                      "in `dflash_config`, model.safetensors with the codebooks under names without `.weight`, no "
                      "embedding or lm_head: the target's are used): z-lab's `DFlash2DraftModel` and vLLM load it."})
