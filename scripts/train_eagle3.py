"""Train a draft head (any registered ``draft.head``) against a frozen HF target, online or from stored
features (``features.path``). One trainer for every head; the file name is historical.

    headstart train --config configs/demo/eagle3.yaml                               # one process
    torchrun --nproc_per_node 2 -m headstart.train --config configs/demo/eagle3.yaml  # or scripts/train_eagle3.py
    torchrun --nproc_per_node 2 scripts/train_eagle3.py --config configs/demo/medusa.yaml
    python scripts/train_eagle3.py --config my.yaml --train.lr=3e-4 --parallel.backend=deepspeed --resume

An output_dir that holds a run is continued with --resume (on any world size) or moved aside with
--overwrite; without either the command stops before touching it.

Any config key can be overridden as --section.key=value; an unknown key is an error.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch.distributed as dist

from headstart.trainer.config import load_config
from headstart.trainer.distributed import barrier, init_distributed
from headstart.trainer.errors import report_error
from headstart.trainer.output_dir import TRAINING_RUN, claim_output_dir
from headstart.trainer.run import build_trainer


def finished(output_dir: str, target: str, final: dict | None, best: dict | None) -> str:
    """The main job's last lines: where the head is, how well it drafts, and the command to run next."""
    head = Path(output_dir) / "final"
    score = ""
    if final:
        score = f": simulated acceptance length {final.get('sim_accept_len', float('nan')):.3f}"
        score += f", decode tau {final['decode_tau']:.3f}" if "decode_tau" in final else ""
    lines = [f"done. The trained head is in {head}{score}."]
    if best:
        lines.append(f"Its best evaluation ({best['metric']} {best['value']:.3f} at step {best['step']}) is in "
                     f"{Path(output_dir) / 'best'}.")
    lines.append(f"Next: headstart check --head {head} --target {target}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="recipe YAML")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    p.add_argument("--overwrite", action="store_true",
                   help="move the run in output_dir aside (to <output_dir>.old-<time>) and start again")
    args, overrides = p.parse_known_args(argv)
    try:
        config = load_config(args.config, overrides)
        info = init_distributed()
        claim_output_dir(config.output_dir, TRAINING_RUN, "training run", args.resume, args.overwrite, info)
        trainer = build_trainer(config, info)
        final = trainer.train(resume=args.resume)
        barrier()  # leave together: no rank tears down gloo/NCCL while another still writes the export
        if info.is_main:
            print(finished(config.output_dir, config.target.path, final, trainer.run_dir.best), flush=True)
    except (ValueError, OSError, ImportError) as err:  # OSError: a full disk, an unwritable output_dir
        return report_error(err)
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
