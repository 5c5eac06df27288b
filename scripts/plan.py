"""What a recipe's training step needs per GPU, before any weight is loaded: parameters of the target and the head,
per-GPU peak memory by part, tokens per step, the offline feature store's size, and whether it fits.

    headstart plan --config configs/llama3.1-8b/eagle3_online.yaml --target-config configs/llama3.1-8b --gpus 8 --gpu-memory 80
    headstart plan --config configs/demo/eagle3.yaml --gpus 2 --device cpu

The target's config.json comes from --target-config (a file or its directory) or the recipe's target.path; recipe
fields take --section.key=value overrides as in training. Exit status 1 when it does not fit --gpu-memory.
"""

from __future__ import annotations

import argparse
import sys

from headstart.trainer.config import load_config
from headstart.trainer.errors import report_error
from headstart.trainer.plan import plan
from headstart.scripts.command import entry_point, refusals


@refusals
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="recipe YAML")
    p.add_argument("--gpus", type=int, default=1, help="ranks training together (GPUs, or CPU processes)")
    p.add_argument("--gpu-memory", type=float, default=None, help="GiB per GPU: say whether the step fits")
    p.add_argument("--target-config", default=None, help="the target's config.json (or its directory), if the recipe's "
                                                          "target.path is not on this machine")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="where it trains (default: the recipe's target.device)")
    args, overrides = p.parse_known_args(argv)
    try:
        config = load_config(args.config, overrides)
        result = plan(config, args.gpus, args.gpu_memory, args.target_config, args.device)
    except (ValueError, OSError) as err:
        return report_error(err)
    print(result.render(args.config))
    return 1 if result.fits is False else 0


if __name__ == "__main__":
    sys.exit(entry_point(main))
