"""Train a draft head (``draft.head``: eagle3 | medusa) against a frozen HF target, online or from stored
features (``features.path``). One trainer for every head; the name is historical.

    torchrun --nproc_per_node 2 scripts/train_eagle3.py --config configs/demo/eagle3.yaml
    torchrun --nproc_per_node 2 scripts/train_eagle3.py --config configs/demo/medusa.yaml
    python scripts/train_eagle3.py --config my.yaml --train.lr=3e-4 --parallel.backend=deepspeed --resume

Any config key can be overridden as --section.key=value; an unknown key is an error.
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch.distributed as dist

from headstart.trainer.config import load_config
from headstart.trainer.distributed import barrier
from headstart.trainer.run import build_trainer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="recipe YAML")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    args, overrides = p.parse_known_args(argv)
    try:
        config = load_config(args.config, overrides)
        trainer = build_trainer(config)
        trainer.train(resume=args.resume)
        barrier()  # leave together: no rank tears down gloo/NCCL while another still writes the export
    except (ValueError, FileNotFoundError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        # Free the trainer (FSDP/DeepSpeed keep handles of finished collectives) while the process group and
        # the interpreter are alive; dropping them during interpreter shutdown can abort a gloo worker thread.
        trainer = None
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
