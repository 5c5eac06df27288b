"""Fit a static Medusa tree of N nodes to trained heads: measure each head's top-k accuracy on the
target's own greedy continuations, then keep the N rank paths of highest expected acceptance (the
Medusa paper's construction, ``decode.tree.best_static_tree``).

    python scripts/medusa_tree.py --config configs/demo/medusa_full.yaml --draft configs/demo/medusa-head \
        --nodes 32 --out configs/trees/medusa-demo-32.json
    python scripts/medusa_tree.py --target /models/my-target --draft runs/medusa/final \
        --questions my_prompts.jsonl --nodes 64 --out my-tree.json

Prompts: ``--config RECIPE`` uses the recipe's held-out conversations (the rows training held out,
up to their first trained token), so the tree is not fitted to the benchmark's questions;
``--questions FILE`` takes the first turn of Spec-Bench-format questions instead. The output is a
JSON list of rank paths, the format ``scripts/benchmark.py --tree-paths`` reads.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from headstart.decode.questions import prompt_ids, read_questions
from headstart.heads.medusa.drafter import rank_accuracy
from headstart.decode.target_runner import TargetRunner
from headstart.decode.tree import best_static_tree, expected_accept_length
from headstart.heads.registry import load_head
from headstart.models.target import Target, TargetConfig, load_tokenizer
from headstart.trainer.batches import split_eval
from headstart.trainer.config import load_config
from headstart.trainer.data import build_dataset
from headstart.trainer.decode_eval import held_out_prompts
from headstart.scripts.command import entry_point, refusals


def held_out_prompts_of(recipe: str, n: int) -> tuple[str, list[torch.Tensor]]:
    config = load_config(recipe)
    dataset, _ = build_dataset(config.data, load_tokenizer(config.target.path, config.target.trust_remote_code))
    _, eval_data = split_eval(dataset, config.train.eval_fraction, config.train.seed)
    if eval_data is None:
        raise ValueError(f"{recipe}: train.eval_fraction is 0, so no conversations are held out; use --questions")
    return config.target.path, held_out_prompts(eval_data, n)


@refusals
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", required=True, help="the Medusa heads' directory (vLLM layout)")
    p.add_argument("--config", help="training recipe: its target and held-out conversations")
    p.add_argument("--target", help="target directory (with --questions)")
    p.add_argument("--questions", help="Spec-Bench-format questions (first turns are used)")
    p.add_argument("--prompts", type=int, default=32, help="how many prompts to continue")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--nodes", type=int, default=32, help="tree size (draft tokens verified per round)")
    p.add_argument("--max-rank", type=int, default=10, help="candidates per head considered")
    p.add_argument("--out", required=True, help="JSON file for the tree's rank paths")
    p.add_argument("--allow-other-target", action="store_true", help="use heads trained for another target")
    args = p.parse_args(argv)
    if bool(args.config) == bool(args.questions):
        p.error("give either --config (held-out conversations) or --target with --questions")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.config:
        target_path, prompts = held_out_prompts_of(args.config, args.prompts)
    else:
        if not args.target:
            p.error("--questions needs --target")
        target_path, tokenizer = args.target, load_tokenizer(args.target)
        prompts = [prompt_ids(tokenizer, [{"role": "user", "content": q["turns"][0]}])
                   for q in read_questions(args.questions)[: args.prompts]]
    target = Target.from_pretrained(TargetConfig(path=target_path, dtype="bfloat16" if device == "cuda" else "float32",
                                                 device=device))
    heads = load_head("medusa", args.draft, target, args.allow_other_target).to(device=device, dtype=target.lm_head_weight.dtype)
    tokenizer = load_tokenizer(target_path)
    eos = {t for t in [tokenizer.eos_token_id, target.model.generation_config.eos_token_id] if isinstance(t, int)}
    runner = TargetRunner(target, max_len=max(x.shape[1] for x in prompts) + args.max_new_tokens + 2, with_aux=False)
    accuracy = rank_accuracy(runner, heads, [x.to(device) for x in prompts], args.max_new_tokens, eos, args.max_rank)
    paths = best_static_tree(accuracy, args.nodes)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("[" + ",\n ".join(json.dumps(list(x)) for x in paths) + "]\n")
    print(f"measured on {len(prompts)} prompts x up to {args.max_new_tokens} greedy tokens of the target")
    print("| head | " + " | ".join(f"rank {r}" for r in range(min(5, args.max_rank))) + " | top-5 |")
    print("|---|" + "---|" * (min(5, args.max_rank) + 1))
    for i, row in enumerate(accuracy.tolist()):
        print(f"| {i + 1} | " + " | ".join(f"{a:.3f}" for a in row[:5]) + f" | {sum(row[:5]):.3f} |")
    print(f"tree of {len(paths)} nodes, depth {max(map(len, paths))}: expected tau {expected_accept_length(paths, accuracy):.2f} "
          f"(levels treated as independent) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(entry_point(main))
