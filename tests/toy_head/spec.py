"""The toy head's catalog entry."""

from __future__ import annotations

from headstart.heads.spec import HeadSpec

from toy_head.drafter import ToyDrafter
from toy_head.module import ToyHead, ToyOptions, build_toy, detect_toy

TOY = HeadSpec(title="toy head", cls=ToyHead, options=ToyOptions, build=build_toy, drafter=ToyDrafter, detect=detect_toy,
               unit="step s (predicts token t+s+2)", trained_depth=lambda config: config.get("num_steps"),
               cards={"headstart": "the test tree's toy layout (config.json `HeadstartToyHead`, model.safetensors)"})
