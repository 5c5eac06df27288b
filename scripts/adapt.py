"""Adapt a trained head to the traffic a server sent it: fine-tune it on the replies it served, a share of its original
data replayed against forgetting, then check the new export.

    headstart adapt --head runs/demo-eagle3/final --target configs/demo/target --log requests.jsonl --output runs/adapted
    headstart adapt ... --recipe configs/demo/eagle3_regenerated.yaml --steps 300 --replay-share 0.25 --questions q.jsonl
    headstart adapt ... --from-scratch        # the same data and steps from a fresh head: what adapting is worth

The log (trainer/request_log.py): OpenAI chat completions as served (``request.messages`` and ``response.choices``; a
vLLM server's token ids, where it returned them, are checked against the target's tokenizer and chat template), or
conversations. The head must be an export of a head that learns from what it serves (its catalog entry's
``learns_online``) for this target. The recipe gives the head's shape and the optimizer (default: the
``run_config.json`` next to the head, where ``headstart train`` left one); ``--replay`` the original data (default: the
recipe's ``data.files``). The target's states on the served replies are captured as training does (the target runs in
the training process); the head starts from its export (``draft.init_from``). Writes OUTPUT/data/ (the served and the
replayed conversations), OUTPUT/run/ (the training run: --resume continues it, --overwrite moves it aside) and the
adapted head in OUTPUT/run/final, then runs ``headstart check`` on it. Any recipe key can be overridden as
``--section.key=value``; ``--nproc-per-node N`` trains on N local processes.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from headstart.heads.exports import check_readable, detect_layout
from headstart.heads.registry import HEADS, head_spec
from headstart.models.errors import UserError
from headstart.models.provenance import check_target
from headstart.models.target import load_tokenizer
from headstart.scripts import check_head, train_eagle3
from headstart.scripts.command import entry_point, refusals
from headstart.trainer.config import load_config
from headstart.trainer.conversations import detect_format, to_messages
from headstart.trainer.data import read_rows
from headstart.trainer.output_dir import TRAINING_RUN, claim_output_dir
from headstart.trainer.request_log import served_conversations


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="headstart adapt", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", required=True, help="the head's exported directory (a run's final/, or a published head)")
    p.add_argument("--target", required=True, help="the target it drafts for (the one that served the log)")
    p.add_argument("--log", required=True, help="the server's request log (JSON lines)")
    p.add_argument("--output", required=True, help="where the data, the run and the adapted head go")
    p.add_argument("--recipe", default=None, help="the recipe the head was trained with (default: run_config.json next to it)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps of the fine-tune")
    p.add_argument("--replay", nargs="+", default=None, metavar="FILE",
                   help="the original data to replay (default: the recipe's data.files)")
    p.add_argument("--replay-share", type=float, default=0.25,
                   help="the share of replayed conversations among those trained on (0: the log alone)")
    p.add_argument("--from-scratch", action="store_true",
                   help="train a fresh head of the recipe on the same data instead (the baseline adapting must beat)")
    p.add_argument("--questions", default=None, help="check the adapted head's decode tau on these questions too")
    p.add_argument("--seed", type=int, default=0, help="which replayed conversations are drawn")
    p.add_argument("--resume", action="store_true", help="continue the run in OUTPUT/run")
    p.add_argument("--overwrite", action="store_true", help="move the run in OUTPUT/run aside and start again")
    p.add_argument("--nproc-per-node", type=int, default=None, help="train on this many local processes")
    return p


def head_of(directory: str, target: str) -> str:
    """The catalog name of the head exported in ``directory``, refused by name where it cannot adapt or was trained
    for another target."""
    check_readable(directory, "--head")
    found = detect_layout(Path(directory))
    if found is None:
        raise UserError(f"--head {directory}: not an export of any head headstart knows ({', '.join(HEADS)})")
    name = found[0]
    if not head_spec(name).learns_online:
        able = ", ".join(n for n, s in HEADS.items() if s.learns_online)
        raise UserError(f"--head {directory} is an export of a {head_spec(name).title}, whose loss reads what a served reply's "
                        f"target states do not give: it cannot adapt to a log (heads that can: {able})")
    check_target(directory, target)
    return name


def recipe_of(args: argparse.Namespace, name: str) -> str:
    recipe = args.recipe or str(Path(args.head).parent / "run_config.json")
    if not Path(recipe).is_file():
        raise UserError(f"--recipe: no recipe given and no {recipe} next to the head: pass the recipe the head was "
                        "trained with (its shape and optimizer)")
    trains = load_config(recipe).draft.head
    if trains != name:
        raise UserError(f"--recipe {recipe} trains a {trains} head; --head {args.head} is a {name} head")
    return recipe


def replayed(files: list[str], n: int, seed: int) -> list[list[dict]]:
    """``n`` conversations drawn from ``files`` (the original data, in any format training reads)."""
    pool = [to_messages(row, detect_format(row)) for f in files for row in read_rows(f)]
    if n > len(pool):
        raise UserError(f"--replay-share asks for {n} replayed conversations; {', '.join(files)} hold {len(pool)}")
    return random.Random(seed).sample(pool, n)


def write_jsonl(path: Path, conversations: list[list[dict]]) -> None:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))


@refusals
def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args, overrides = p.parse_known_args(argv)
    if not 0 <= args.replay_share < 1:
        p.error(f"--replay-share {args.replay_share}: must be in [0, 1)")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    name = head_of(args.head, args.target)
    recipe = recipe_of(args, name)
    out = Path(args.output)
    if not (args.resume or args.overwrite):  # a finished run there is refused before anything is written
        claim_output_dir(out / "run", TRAINING_RUN, "training run", False, False)
    served = served_conversations(args.log, load_tokenizer(args.target))
    n_replay = round(len(served) * args.replay_share / (1 - args.replay_share))
    files = [out / "data" / "served.jsonl"]
    (out / "data").mkdir(parents=True, exist_ok=True)
    write_jsonl(files[0], served)
    if n_replay:
        files.append(out / "data" / "replayed.jsonl")
        write_jsonl(files[1], replayed(args.replay or list(load_config(recipe).data.files), n_replay, args.seed))
    print(f"{len(served)} served conversations from {args.log}, {n_replay} replayed: {args.steps} steps from "
          f"{'a fresh head' if args.from_scratch else args.head}", flush=True)
    run = out / "run"
    train_argv = ["--config", recipe, f"--target.path={args.target}", f"--data.files=[{','.join(map(str, files))}]",
                  f"--output_dir={run}", f"--train.max_steps={args.steps}", "--features.path=null",
                  *([] if args.from_scratch else [f"--draft.init_from={args.head}"]), *overrides,
                  *(["--resume"] if args.resume else []), *(["--overwrite"] if args.overwrite else []),
                  *([f"--nproc-per-node={args.nproc_per_node}"] if args.nproc_per_node else [])]
    status = train_eagle3.main(train_argv)
    if status:
        return status
    return check_head.main(["--head", str(run / "final"), "--target", args.target,
                            *(["--questions", args.questions] if args.questions else [])])


if __name__ == "__main__":
    raise SystemExit(entry_point(main))
