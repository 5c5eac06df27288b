"""Held-out per-step accuracy of a finished head under any recipe settings, e.g. an MTP layer trained
with 1 unrolled step evaluated over 3 (how a recurrent drafter is used):

    python scripts/evaluate_head.py --config configs/demo/mtp_full.yaml --head runs/mtp-unroll1/final --draft.ttt_steps=3

The recipe's held-out rows (the same split as training), featurised as in training (online, or from
``features.path``); the head's exported tensors are loaded into a head built by the recipe.
"""

from __future__ import annotations

import argparse
import json
import sys

from headstart.heads.registry import load_head
from headstart.trainer.config import load_config
from headstart.trainer.run import build_trainer
from headstart.scripts.command import entry_point, refusals


@refusals
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="recipe YAML")
    p.add_argument("--head", required=True, help="the head's exported directory")
    p.add_argument("--allow-other-target", action="store_true", help="evaluate a head trained for another target")
    args, overrides = p.parse_known_args(argv)
    config = load_config(args.config, [*overrides, "--output_dir=runs/.evaluate_head", "--logging.progress=false"])
    trainer = build_trainer(config)
    module = trainer.backend.module
    finished = load_head(config.draft.head, args.head, trainer.features.target, args.allow_other_target)
    missing, unexpected = module.load_state_dict(finished.state_dict(), strict=False)
    trained = {n for n, q in module.named_parameters() if q.requires_grad}
    if trained & set(missing) or unexpected:
        raise SystemExit(f"{args.head} does not fill this recipe's head: missing {sorted(trained & set(missing))[:5]}, "
                         f"unexpected {unexpected[:5]}")
    metrics = trainer.evaluate()
    steps = sorted(int(k.split("_")[1]) for k in metrics if k.startswith("acc_"))
    print(json.dumps({"head": args.head, **{k: round(v, 4) for k, v in metrics.items()}}))
    print("| step | " + " | ".join(str(k) for k in steps) + " | sim accept len |")
    print("|---|" + "---|" * (len(steps) + 1))
    print("| accuracy | " + " | ".join(f"{metrics[f'acc_{k}']:.3f}" for k in steps) + f" | {metrics['sim_accept_len']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(entry_point(main))
