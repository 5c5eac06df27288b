"""P-EAGLE's catalog entry: its module, options, drafter, export detector, checker and converter."""

from __future__ import annotations

from functools import partial

from headstart.heads.eagle3.convert import convert_eagle3
from headstart.heads.peagle.check import check_peagle, detect_peagle, peagle_trained_depth
from headstart.heads.peagle.config import PEagleConfig, PEagleOptions
from headstart.heads.peagle.drafter import PEagleDrafter
from headstart.heads.peagle.module import PEagleDraft, build_peagle
from headstart.heads.spec import HeadSpec

PEAGLE = HeadSpec(
    learns_online=True,
    title="P-EAGLE head", cls=PEagleDraft, options=PEagleOptions, build=build_peagle, drafter=PEagleDrafter,
    detect=detect_peagle, check=check_peagle, convert=partial(convert_eagle3, config_class=PEagleConfig),
    unit="depth k", trained_depth=peagle_trained_depth, tiny={"draft_vocab_size": 64, "parallel_tokens": 3},
    cards={"flat": "EAGLE-3's flat layout plus `mask_hidden` and the placeholder token (`mask_token_id`, `pard_token`): "
                   "vLLM serves it as EAGLE-3 with `\"parallel_drafting\": true` in `--speculative-config`; SGLang has "
                   "no parallel drafting.",
           "speculators": "vLLM's speculators layout (`speculators_model_type: peagle`; `vllm serve` detects it)."})
