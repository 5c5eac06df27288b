"""DSpark's catalog entry: its module, options, drafter and export detector."""

from __future__ import annotations

from headstart.heads.dspark.check import detect_dspark
from headstart.heads.dspark.config import DSparkOptions
from headstart.heads.dspark.drafter import DSparkDrafter
from headstart.heads.dspark.module import DSparkDraft, build_dspark
from headstart.heads.spec import HeadSpec

DSPARK = HeadSpec(
    learns_online=True,
    title="DSpark head", cls=DSparkDraft, options=DSparkOptions, build=build_dspark, drafter=DSparkDrafter,
    detect=detect_dspark, unit="block slot k (predicts token t+k+1)",
    tiny={"block_size": 4, "anchors": 1000, "markov_rank": 8},
    trained_depth=lambda config: config.get("block_size"),
    cards={"dspark": "the DSpark layout vLLM, SGLang and SpecForge read (config.json `DSparkDraftModel` with the Markov and confidence fields at "
                     "the top level and in `dflash_config`, model.safetensors without the embedding or lm_head: the "
                     "target's are used): vLLM (`\"method\": \"dspark\"`) and SGLang (`--speculative-algorithm DSPARK`) "
                     "load it."})
