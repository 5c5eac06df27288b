"""Train a draft head (any registered ``draft.head``) against a frozen HF target, online or from stored
features (``features.path``). One trainer for every head; the file name is historical.

    headstart train --config configs/demo/eagle3.yaml                               # one process
    headstart train --nproc-per-node 2 --config configs/demo/eagle3.yaml            # 2 processes, launched here
    headstart train --nnodes 2 --rdzv-endpoint node0:29500 --nproc-per-node 8 --config my.yaml  # on each node
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
import logging
import os
import sys
from pathlib import Path

import torch.distributed as dist

from headstart.trainer.config import load_config
from headstart.trainer.distributed import barrier, init_distributed
from headstart.trainer.errors import report_error
from headstart.trainer.output_dir import TRAINING_RUN, claim_output_dir
from headstart.trainer.run import build_trainer
from headstart.scripts.command import entry_point, refusals


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


LAUNCHER_FLAGS = ("--nproc-per-node", "--nnodes", "--rdzv-endpoint", "--rdzv-id")
"""This command's own launch options: the launcher reads them, its ranks never see them."""


def rendezvous(nnodes: int, endpoint: str | None, rdzv_id: str) -> list[str]:
    """torchrun's rendezvous options: standalone on one node; on several, c10d at ``endpoint`` (host:port of one of
    the nodes, the same on every node), which numbers the ranks of all nodes as one job."""
    if nnodes == 1:
        return ["--standalone"]
    if not endpoint:
        raise ValueError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT, the same on every node (a node's address "
                         "and a free port: its launcher hosts the rendezvous)")
    return [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}"]


def launch(nproc: int, argv: list[str], nnodes: int = 1, endpoint: str | None = None, rdzv_id: str = "headstart") -> int:
    """This command on ``nproc`` local processes (of ``nnodes`` nodes, each running this same command), launched by
    torchrun's own launcher in this process, so that a refusal every rank makes (a finished run in output_dir, a bad
    recipe) is printed alone, not under torchrun's ChildFailedError traceback; exit status 2 then, as in one process."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.run import get_args_parser, run

    logging.getLogger("torch.distributed").setLevel(logging.CRITICAL)  # its per-worker failure lines
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for its ranks, without its banner about it
    args = get_args_parser().parse_args([*rendezvous(nnodes, endpoint, rdzv_id), f"--nproc-per-node={nproc}",
                                         "-m", "headstart.train", *argv])
    try:
        run(args)
    except ChildFailedError as err:
        _, failure = err.get_first_failure()
        message = failure.message.get("message") if isinstance(failure.message, dict) else failure.message
        if not isinstance(message, str) or not message.startswith("error: "):  # not a refusal: a crash, shown above
            message = f"error: training failed on local rank {failure.local_rank} (exit code {failure.exitcode}); see above"
        print(message, file=sys.stderr)
        return 2
    except RendezvousConnectionError:
        # The node hosting the rendezvous store (the one at --rdzv-endpoint) left: its ranks stopped (a refusal every
        # rank makes, a crash, a lost machine) before this node's launcher saw its own ranks stop.
        print(f"error: the node hosting the job's rendezvous at {endpoint} stopped, so this node's ranks cannot go on: "
              "that node's output says why", file=sys.stderr)
        return 1
    return 0


@refusals
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="launch this many local processes (as torchrun --nproc_per_node) from this command")
    p.add_argument("--nnodes", type=int, default=1,
                   help="nodes of the job: run this same command on each, with the same --rdzv-endpoint")
    p.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous (one node's address) for --nnodes > 1")
    p.add_argument("--rdzv-id", default="headstart", help="the job's name at the rendezvous (the same on every node)")
    p.add_argument("--config", help="recipe YAML")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    p.add_argument("--overwrite", action="store_true",
                   help="move the run in output_dir aside (to <output_dir>.old-<time>) and start again")
    args, overrides = p.parse_known_args(argv)
    if (args.nproc_per_node or args.nnodes > 1) and "LOCAL_RANK" not in os.environ:  # the launcher, not a rank
        argv = sys.argv[1:] if argv is None else argv
        rest = [a for i, a in enumerate(argv) if not a.startswith(LAUNCHER_FLAGS)
                and not (i > 0 and argv[i - 1] in LAUNCHER_FLAGS)]
        try:
            return launch(args.nproc_per_node or 1, rest, args.nnodes, args.rdzv_endpoint, args.rdzv_id)
        except ValueError as err:
            return report_error(err)
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
    sys.exit(entry_point(main))
