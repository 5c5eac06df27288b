"""``--online`` and its flags, for ``headstart bench`` and ``generate``: a head that learns from what it serves
(trainer/online.py). Refused by name for a method that is not a catalog head declaring ``learns_online``."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from headstart.decode.methods import DraftingMethod
from headstart.heads.registry import HEADS, head_spec
from headstart.models.provenance import fingerprint
from headstart.models.target import Target, load_tokenizer
from headstart.trainer.config import TrainConfig, load_config
from headstart.trainer.data import DataConfig, build_dataset
from headstart.trainer.online import OnlineLearner, OnlineSchedule, Replay

FLAGS = ("online_every", "online_steps", "online_buffer", "online_recipe", "online_lr", "online_save", "online_replay")


def add_online_args(p: argparse.ArgumentParser) -> None:
    s = OnlineSchedule()
    p.add_argument("--online", action="store_true",
                   help="the head keeps learning from the requests it serves (online speculative decoding): their "
                        "target states, kept from the verify passes, go into a replay buffer, and every "
                        "--online-every requests it takes --online-steps optimizer steps on it; the output stays "
                        "the target's")
    p.add_argument("--online-every", type=int, default=s.every, metavar="N", help="served requests between updates")
    p.add_argument("--online-steps", type=int, default=s.steps, metavar="K", help="optimizer steps per update")
    p.add_argument("--online-buffer", type=int, default=s.buffer_tokens, metavar="TOKENS",
                   help="the replay buffer's size in served tokens (the oldest requests leave first)")
    p.add_argument("--online-recipe", default=None, metavar="YAML",
                   help="a training recipe whose train: section (optimizer, lr, betas, weight decay, clip, batch size, "
                        "mixed precision) the updates use, at a constant rate; default: the recipe defaults")
    p.add_argument("--online-lr", type=float, default=None, metavar="LR",
                   help="the updates' learning rate (default: --online-recipe's train.lr, the peak of a run from "
                        "scratch; a lower one forgets less of the head's original domain and follows the traffic "
                        "more slowly)")
    p.add_argument("--online-replay", nargs="*", default=None, metavar="FILE",
                   help="against forgetting: every update step also trains on as many of these conversations (the "
                        "head's original data, in any format training reads; none named: --online-recipe's "
                        "data.files), their target states from a forward of the target")
    p.add_argument("--online-save", default=None, metavar="DIR",
                   help="export the head as it learned by the end of the run to DIR (a head's exported directory: "
                        "`headstart check`, a server, or another run's --draft)")


def online_refusal(p: argparse.ArgumentParser, args: argparse.Namespace, method: DraftingMethod) -> str | None:
    """Why these ``--online`` flags cannot run with this method and these flags; None: they can."""
    given = [f for f in FLAGS if getattr(args, f) != p.get_default(f)]
    if not args.online:
        return f"--{given[0].replace('_', '-')} sets --online's updates: add --online" if given else None
    if method.head is None or not head_spec(method.head).learns_online:
        what = (f"the {head_spec(method.head).title}'s loss reads what a verify pass does not give" if method.head
                else "it is not a trained head")
        learners = sorted(name for name, spec in HEADS.items() if spec.learns_online)
        return f"--online: --method {args.method} cannot learn as it serves ({what}); heads that can: {', '.join(learners)}"
    if args.batch_size > 1:
        return "--online learns from one sequence at a time: use --batch-size 1"
    if args.hybrid_ngram is not None:
        return "--online trains the head alone: drop --hybrid-ngram"
    if args.online_save and args.draft and Path(args.online_save).resolve() == Path(args.draft).resolve():
        return f"--online-save {args.online_save} is the head --draft reads: save the learned head elsewhere"
    if args.online_recipe is not None and not Path(args.online_recipe).is_file():
        return f"--online-recipe {args.online_recipe}: no such file"
    if args.online_lr is not None and not args.online_lr > 0:
        return f"--online-lr must be > 0, got {args.online_lr}"
    if args.online_replay == [] and args.online_recipe is None:
        return "--online-replay without files replays --online-recipe's data.files: name the files or the recipe"
    missing = [f for f in args.online_replay or [] if not Path(f.split("[")[0]).is_file()]
    if missing:
        return f"--online-replay: no such file {', '.join(missing)}"
    try:
        schedule_of(args)
    except ValueError as err:
        return str(err)
    return None


def schedule_of(args: argparse.Namespace) -> OnlineSchedule:
    return OnlineSchedule(args.online_every, args.online_steps, args.online_buffer)


def online_learner(args: argparse.Namespace, head, target: Target) -> OnlineLearner:
    """The learner for ``head`` (the one the method's drafters read), with ``--online-recipe``'s train section."""
    recipe = load_config(args.online_recipe) if args.online_recipe else None
    replay = None
    if args.online_replay is not None:  # tokenized as training tokenizes them, with the recipe's data settings
        data = replace(recipe.data if recipe else DataConfig(), files=tuple(args.online_replay or recipe.data.files))
        dataset, _ = build_dataset(data, load_tokenizer(args.target))
        replay = Replay(dataset, seed=recipe.train.seed if recipe else 0)
    train = recipe.train if recipe else TrainConfig()
    if args.online_lr is not None:
        train = replace(train, lr=args.online_lr)
    return OnlineLearner(head, target, schedule_of(args), train, replay)


def save_learned(args: argparse.Namespace, learner: OnlineLearner | None, head_name: str | None) -> None:
    """``--online-save``: the learned head, exported for the target it served."""
    if learner is not None and args.online_save:
        learner.export(args.online_save, head_name, fingerprint(args.target))
        print(f"the head as it learned ({learner.describe()}) is in {args.online_save}", flush=True)
