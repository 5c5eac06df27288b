"""Answer one prompt with speculative decoding: the reply, then its tau and tokens/s (--compare: plain decoding's too).

    headstart generate --target configs/demo/target --method eagle3 --draft configs/demo/eagle3-head \
        --prompt "Natalia sold clips to 48 of her friends in April. How many did she sell?"
    headstart generate ... --prompt-file question.txt --tree --compare
    headstart generate ... --temperature 0.7 --top-p 0.9 --seed 1

The prompt goes through the target's chat template (``--system`` adds a system message; a base model without a
template gets the text as it is). Every drafter and flag of ``headstart bench`` works here (``--method``, ``--draft``,
``--tree``, ``--ngram-store``, ``--hybrid-ngram``, ``--compile``, ...). The reply goes to stdout, the numbers to stderr.
--compare also decodes plainly on the same runner and reports the speed-up and, greedy, whether the two outputs are
the same token for token (bf16 may differ at a near-tie of the target's logits: decode/exactness.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from headstart.decode.measure import sync
from headstart.decode.questions import decode_setup, prompt_ids
from headstart.decode.clock import RoundClock
from headstart.decode.exactness import GreedyCheck
from headstart.decode.generate import plain_generate
from headstart.scripts.benchmark import (add_decoding_args, add_method_args, build_method, check_args, check_inputs,
                                         sampling_of)
from headstart.scripts.command import entry_point, refusals
from headstart.scripts.online_args import save_learned
from headstart.heads.methods import drafting_methods


@refusals
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the user's message")
    prompt.add_argument("--prompt-file", help="a file holding the user's message")
    p.add_argument("--system", default=None, help="a system message before the prompt")
    p.add_argument("--compare", action="store_true",
                   help="also decode plainly: the speed-up, and (greedy) whether the outputs are the same")
    add_method_args(p)
    add_decoding_args(p)
    # what build_method and check_args read of the benchmark's own flags: one sequence, nothing predicted
    p.set_defaults(batch_size=1, predict=False, verify_greedy=False, questions=None)
    args = p.parse_args(argv)
    check_args(p, args)
    check_inputs(args)  # the target's and the head's files, before either loads
    if args.prompt_file is not None and not Path(args.prompt_file).is_file():
        p.error(f"--prompt-file {args.prompt_file}: no such file")
    text = args.prompt if args.prompt is not None else Path(args.prompt_file).read_text()
    if not text.strip():
        p.error("the prompt is empty")
    setup = decode_setup(args.target, args.dtype, None)
    method = build_method(p, args, setup)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": text}]
    ids = prompt_ids(setup.tokenizer, messages).to(setup.device)
    rival = method.rival()
    sampling = sampling_of(args)
    generator = torch.Generator(device=setup.device)
    # untimed: the first call's one-off costs (allocations, kernel choice, a compiled graph's first run)
    warm_tokens = min(args.max_new_tokens, max(8, rival.depth + 2))
    rival.warm_up(ids, setup.eos, sampling, generator, warm_tokens)
    if args.compare:
        plain_generate(method.runner, ids, warm_tokens, setup.eos, sampling, generator)
    drafter = None if method.own_loop else method.make()  # built before the clock, as the benchmark's are
    sync(setup.device)
    start = time.perf_counter()
    generator.manual_seed(args.seed)
    out = rival.decode(drafter, ids, args.max_new_tokens, setup.eos, sampling, generator, RoundClock(setup.device))
    sync(setup.device)
    seconds = time.perf_counter() - start
    print(setup.tokenizer.decode(out.tokens, skip_special_tokens=True))
    speed = len(out.tokens) / seconds
    print(f"{args.method}: {len(out.tokens)} tokens in {seconds:.2f} s ({speed:.1f} tokens/s), tau {out.tau:.2f} "
          f"({out.target_forwards} target forwards after the prompt's)", file=sys.stderr)
    save_learned(args, method.learner, drafting_methods()[args.method].head)  # --online-save: what the reply taught it
    if not args.compare:
        return 0
    start = time.perf_counter()
    generator.manual_seed(args.seed)
    plain = plain_generate(method.runner, ids, args.max_new_tokens, setup.eos, sampling, generator)
    sync(setup.device)
    plain_speed = len(plain.tokens) / (time.perf_counter() - start)
    print(f"plain decoding: {len(plain.tokens)} tokens, {plain_speed:.1f} tokens/s: speed-up {speed / plain_speed:.2f}x",
          file=sys.stderr)
    if sampling is not None:
        return 0
    check = GreedyCheck(setup.target.model)
    check.compare("the reply", ids, plain.tokens, out.tokens)
    if check.mismatches:
        print("differs from plain greedy decoding: " + "; ".join(check.mismatches), file=sys.stderr)
        return 1
    print("the same tokens as plain greedy decoding" if not check.near_ties else
          "differs from plain greedy decoding only at a near-tie: " + "; ".join(check.near_ties), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(entry_point(main))
