"""Which draft shape decodes fastest on this machine: chains of k drafts and EAGLE-2 dynamic trees (depth, top-k,
total tokens) of a trained head, and n-gram lookup beside them -- each replayed over the target's own greedy outputs
(decode/replay.py: the drafter runs for real, round by round, and accepts exactly what decoding would), with the
target's verify forward costed from block sizes timed here. One greedy decode per turn serves every shape, so a sweep
of ~50 shapes costs about as much as decoding a few of them, and shapes compare with no timing noise between runs.
``--ngram-trees`` replays the grid's trees with n-gram lookup too; ``--ngram-store FILE...`` adds n-gram lookup with a
datastore of replies (decode/ngram_store.py) beside it, in every n-gram shape. ``--hybrid-scores S,...`` replays the head
behind n-gram lookup (and the datastore) at each minimum score (decode/hybrid.py), in every chain and tree of the head.

    python benchmarks/tree_shapes.py --target targets/SmolLM2-135M-Instruct --method eagle3 \
        --draft runs/smollm2-eagle3-finetune-2k-head --questions configs/smollm2/data/heldout_questions.jsonl \
        --max-new-tokens 128 --dtype bfloat16 --table runs/shapes.md

Modelled speed-up = plain decoding's seconds per token (a one-token forward, timed with the blocks, plus its loop's
own time) / the speculative seconds per token: the drafter's draft and update time and the loop's own time as measured
in the replay, plus what the target would have cost -- each round's verify forward (block costs timed at the outputs'
mean context) and, for trees, the KV cache move of the accepted path (timed by slots moved). Prompts are left out on
both sides; target and drafter run eagerly. Check the winner with `headstart bench`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from headstart.decode.questions import decode_setup, prompt_ids
from headstart.decode.clock import RoundClock
from headstart.decode.generate import speculative_generate
from headstart.decode.hybrid import HybridDrafter, ngram_share
from headstart.decode.ngram import NgramDrafter
from headstart.decode.ngram_store import NgramStore
from headstart.trainer.ngram_corpus import ngram_store_from_conversations
from headstart.decode.replay import ReplayRunner, Turn, record_turn
from headstart.decode.target_runner import TargetRunner
from headstart.decode.tree import DynamicTree
from headstart.heads.registry import HEADS, drafter_for, load_head
from headstart.benchmarks.record import write_table


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def tree_capacity(depth: int, topk: int) -> int:
    """Nodes an EAGLE-2 tree can keep: top-k children of the root, then top-k of the top-k expanded per level."""
    return topk + (depth - 1) * topk * topk


def record_turns(runner: TargetRunner, tokenizer, questions: list[dict], max_new_tokens: int, eos: set[int],
                 clock: RoundClock) -> tuple[list[Turn], int]:
    """Every turn of every question decoded greedily (timed by ``clock``), later turns after the earlier replies (as
    the benchmark does); -> (turns, plain decoding's one-token forwards)."""
    turns, forwards = [], 0
    for q in questions:
        messages = []
        for text in q["turns"]:
            messages.append({"role": "user", "content": text})
            turn = record_turn(runner, prompt_ids(tokenizer, messages).to(runner.device), max_new_tokens, eos, clock)
            turns.append(turn)
            forwards += len(turn.output) - 1
            messages.append({"role": "assistant", "content": tokenizer.decode(turn.output, skip_special_tokens=True)})
    return turns, forwards


def replay_shape(turns: list[Turn], make_drafter, vocab: int, k: int, tree: DynamicTree | None,
                 max_new_tokens: int, eos: set[int]) -> dict:
    """Replay every turn with one shape: tokens, rounds, the blocks verified and slots moved, and the measured
    seconds of the drafter, of the loop, and of the verify lap beyond building the replay's one-hot logits (a tree's
    ancestor mask is built there)."""
    clock = RoundClock(turns[0].prompt.device)
    tokens = rounds = 0
    blocks: list[tuple[int, bool]] = []
    moves: list[int] = []
    fake_s = 0.0
    drafted = {"ngram": 0, "model": 0}  # a hybrid's rounds by drafter (decode/hybrid.py)
    for turn in turns:
        runner = ReplayRunner(turn, vocab)
        drafter = make_drafter()
        gen = speculative_generate(runner, drafter, turn.prompt, max_new_tokens, eos, k, tree=tree, clock=clock)
        if isinstance(drafter, HybridDrafter):
            drafted = {who: drafted[who] + drafter.rounds[who] for who in drafted}
        if gen.tokens != turn.output:  # by construction: anything else is a bug in the replay
            raise RuntimeError("the replay did not reproduce the target's greedy output")
        tokens, rounds = tokens + gen.counted_tokens, rounds + gen.target_forwards
        blocks += runner.blocks
        moves += runner.moves
        fake_s += runner.fake_seconds
    s = clock.seconds
    return {"tokens": tokens, "rounds": rounds, "tau": tokens / max(rounds, 1), "blocks": blocks, "moves": moves,
            "ngram_share": ngram_share(drafted),
            "draft_s": s["draft"], "update_s": s["update"], "other_s": s["other"],
            "mask_s": max(0.0, s["verify"] - fake_s)}


def time_target(runner: TargetRunner, causal: set[int], masked: set[int], moves: set[int], context: int,
                repeats: int) -> tuple[dict[tuple[int, bool], float], dict[int, float]]:
    """Median seconds of what the replay leaves out of the target, after ``context`` tokens: verify forwards over
    ``causal`` and ``masked`` (a tree's: explicit mask and depths) blocks of each size, and ``TargetRunner.keep``
    moving m = each of ``moves`` slots of a tree block (path [0, 2, 4, ..]: the root stays, m nodes move). Timed
    round-robin -- every part once a round, one untimed round first -- so that the machine's drift over the seconds
    this takes falls on every part alike (a shared CPU's one-token forward moved 37 -> 43 ms within a minute here).
    -> ({(tokens, masked): seconds}, {slots moved: seconds})."""
    runner.reset()
    top = max([*causal, *masked, 2 * max(moves, default=0) + 1])
    ids = torch.full((1, context + top), 1, dtype=torch.long, device=runner.device)
    runner.forward(ids[:, :context], last_only=True)
    runner.commit(context)
    runner.forward(ids[:, :top])  # every slot the moves read is written (the block is not committed)

    def tree_block(n: int):
        tril = torch.ones(n, n, dtype=torch.bool, device=runner.device).tril()
        return runner.forward(ids[:, :n], tree_mask=tril, depths=torch.arange(n, device=runner.device))

    def move(m: int) -> None:
        runner.keep([0] + [2 * i for i in range(1, m + 1)])
        runner.cache.rollback(context)

    parts = {("causal", n): (lambda n=n: runner.forward(ids[:, :n])) for n in sorted(causal)}
    parts |= {("masked", n): (lambda n=n: tree_block(n)) for n in sorted(masked)}
    parts |= {("move", m): (lambda m=m: move(m)) for m in sorted(moves)}
    times: dict[tuple[str, int], list[float]] = {key: [] for key in parts}
    for round_ in range(repeats + 1):
        for key, fn in parts.items():
            if runner.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if runner.device.type == "cuda":
                torch.cuda.synchronize()
            if round_:
                times[key].append(time.perf_counter() - t0)
    runner.reset()
    median = {key: sorted(t)[len(t) // 2] for key, t in times.items()}
    return ({(n, kind == "masked"): s for (kind, n), s in median.items() if kind != "move"},
            {m: s for (kind, m), s in median.items() if kind == "move"})


def model(row: dict, cost: dict[tuple[int, bool], float], move_cost: dict[int, float], plain_s: float) -> dict:
    verify_s = sum(cost[b] for b in row["blocks"]) + sum(move_cost[m] for m in row["moves"] if m) + row["mask_s"]
    spec_s = row["draft_s"] + row["update_s"] + row["other_s"] + verify_s
    r = max(row["rounds"], 1)
    ms = {part: 1e3 * row[f"{part}_s"] / r for part in ("draft", "update", "other")}
    return {**{k: v for k, v in row.items() if k not in ("blocks", "moves")}, "verify_s": verify_s,
            "ms_per_round": ms | {"verify": 1e3 * verify_s / r},
            "speedup": row["tokens"] * plain_s / spec_s, "tok_s": row["tokens"] / spec_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--method", choices=sorted(HEADS), required=True, help="the head type (its directory in --draft)")
    p.add_argument("--draft", required=True)
    p.add_argument("--questions", required=True)
    p.add_argument("--per-category", type=int, default=None)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default=None, help="default bfloat16 on a GPU, float32 on a CPU")
    p.add_argument("--chains", type=ints, default=[2, 3, 4, 5, 6], help="chain lengths k")
    p.add_argument("--depths", type=ints, default=[3, 4, 5, 6])
    p.add_argument("--topks", type=ints, default=[2, 4, 8])
    p.add_argument("--totals", type=ints, default=[8, 12, 16, 24, 48])
    p.add_argument("--ngram", type=ints, default=[4], help="n-gram lookup chain lengths, as the reference")
    p.add_argument("--ngram-store", nargs="+", default=None, metavar="FILE",
                   help="conversation files n-gram lookup also consults (decode/ngram_store.py): every n-gram shape runs "
                        "both with and without it")
    p.add_argument("--hybrid-scores", type=floats, default=[],
                   help="also replay the head behind n-gram lookup (with --ngram-store's datastore) at each of these "
                        "minimum scores (decode/hybrid.py), in every chain and tree the head runs")
    p.add_argument("--ngram-learn", action="store_true",
                   help="the datastore (empty without --ngram-store) also learns each reply as it is replayed, turn after "
                        "turn, starting afresh for every shape")
    p.add_argument("--ngram-trees", action="store_true",
                   help="also replay every tree of the grid with n-gram lookup (decode/ngram.py's frequency trees)")
    p.add_argument("--repeats", type=int, default=9, help="timed rounds of the target's parts (median)")
    p.add_argument("--show", type=int, default=12, help="tree rows in the table (the best ones)")
    p.add_argument("--out", default=None, help="write every row to this JSON file")
    p.add_argument("--table", default=None, help="write the table to this markdown file")
    p.add_argument("--note", default="", help="a paragraph under the table")
    p.add_argument("--title", default=None, help="the table's title")
    args = p.parse_args()

    setup = decode_setup(args.target, args.dtype, args.questions, args.limit, args.per_category)
    device, dtype, target, tokenizer, questions, eos = (setup.device, setup.dtype, setup.target, setup.tokenizer,
                                                        setup.questions, setup.eos)
    max_len = target.context_length
    vocab = target.lm_head.weight.shape[0]
    head = load_head(args.method, args.draft, target).to(device=device, dtype=target.lm_head_weight.dtype)
    runner = TargetRunner(target, max_len=max_len, with_aux=HEADS[args.method].cls.needs.aux_hidden_states)
    plain_clock = RoundClock(device)
    turns, plain_forwards = record_turns(runner, tokenizer, questions, args.max_new_tokens, eos, plain_clock)
    recorded_s = (plain_clock.seconds["verify"] + plain_clock.seconds["other"]) / max(plain_forwards, 1)
    # the verify forwards are timed at the mean context of the outputs' decoding steps
    context = round(sum(t.prompt.shape[1] + len(t.output) / 2 for t in turns) / len(turns))
    print(f"{len(turns)} turns recorded; plain decoding {1e3 * recorded_s:.1f} ms a token", flush=True)

    makers = {args.method: lambda: drafter_for(head, max_len), "ngram": lambda: NgramDrafter()}
    store = None
    if args.ngram_store or args.ngram_learn:
        store = ngram_store_from_conversations(args.ngram_store, tokenizer) if args.ngram_store else NgramStore()
        print(f"n-gram store: {store.tokens} tokens of replies counted", flush=True)
        makers["ngram+store"] = lambda: NgramDrafter(store=store, learn=args.ngram_learn)
    ngrams = [m for m in makers if m != args.method]
    store_flags = (f" --ngram-store {' '.join(args.ngram_store)}" if args.ngram_store else "") + (
        " --ngram-learn" if args.ngram_learn else "")
    flags = {"ngram+store": f"--method ngram{store_flags}"}
    for score in args.hybrid_scores:
        name = f"hybrid >= {score:g}"
        makers[name] = lambda score=score: HybridDrafter(drafter_for(head, max_len),
                                                         NgramDrafter(store=store, learn=args.ngram_learn), score)
        flags[name] = f"--method {args.method} --draft {args.draft} --hybrid-ngram {score:g}{store_flags}"
    heads = [m for m in makers if m not in ngrams]  # the head, alone and behind n-gram lookup
    shapes: list[tuple[str, str, int, DynamicTree | None]] = [(m, f"chain k={k}", k, None) for m in ngrams
                                                              for k in args.ngram]
    shapes += [(m, f"chain k={k}", k, None) for m in heads for k in args.chains]
    # a total above what depth and top-k can hold is the full tree: run it once, at its size
    grid = sorted({(d, t, min(n, tree_capacity(d, t))) for d in args.depths for t in args.topks for n in args.totals})
    tree_methods = [*heads, *ngrams] if args.ngram_trees else heads
    shapes += [(m, f"tree depth {d} top-{t} {n} tokens", 0, DynamicTree(d, t, n)) for m in tree_methods
               for d, t, n in grid]
    replay_shape(turns[:1], makers[args.method], vocab, max(args.chains or [4]), None, args.max_new_tokens, eos)  # warm-up
    rows = []
    for method, shape, k, tree in shapes:
        if store is not None:
            store.forget()  # every shape from the same store: what one learned is no other's
        row = replay_shape(turns, makers[method], vocab, k, tree, args.max_new_tokens, eos)
        rows.append({"method": method, "shape": shape, "tree": None if tree is None else vars(tree), **row})
        print(f"{method} {shape}: tau {row['tau']:.2f}" + (f" ({100 * row['ngram_share']:.0f}% n-gram rounds)"
                                                            if method.startswith("hybrid") else ""), flush=True)

    sizes = {masked: {n for r in rows for n, m in r["blocks"] if m == masked} for masked in (False, True)}
    counts = {m for r in rows for m in r["moves"] if m}
    cost, move_cost = time_target(runner, sizes[False] | {1}, sizes[True], counts, context, args.repeats)
    one = cost[(1, False)]
    # plain decoding: a one-token forward timed with the blocks (the same minutes), plus its loop's own time a token
    plain_s = one + plain_clock.seconds["other"] / max(plain_forwards, 1)
    modelled = sorted((model(r, cost, move_cost, plain_s) | {"method": r["method"], "shape": r["shape"]} for r in rows),
                      key=lambda r: -r["speedup"])
    chains = [r for r in modelled if r["tree"] is None]
    best = {m: next((r for r in modelled if r["tree"] is not None and r["method"] == m), None) for m in tree_methods}
    costs = ", ".join(f"{n} tokens {1e3 * s:.1f} ms" for (n, masked), s in sorted(cost.items())
                      if masked and n in {1 + t for _, _, t in grid}) or "-"
    moved = ", ".join(f"{m} slots {1e3 * s:.2f} ms" for m, s in sorted(move_cost.items())) or "-"
    body = (f"`{args.questions}`, {len(turns)} turns, max {args.max_new_tokens} new tokens, target `{args.target}` "
            f"({dtype}, eager), draft `{args.draft}`; every shape replayed over the same greedy outputs "
            + ("(n-gram lookup's store learning each reply, turn after turn, afresh for every shape) " if args.ngram_learn else "")
            + f"(decode/replay.py). The target's costs, timed round-robin after {context} tokens (the outputs' mean context; "
            f"median of {args.repeats}): a one-token forward {1e3 * one:.1f} ms (plain decoding a token: "
            f"{1e3 * plain_s:.1f} ms with its loop; {1e3 * recorded_s:.1f} ms as measured while recording the outputs, "
            f"minutes apart); tree blocks (root + nodes) {costs}; a tree path's cache move {moved}. Modelled speed-up = "
            "plain seconds a token / (draft + update + loop time measured in the replay + the verify forwards, cache "
            "moves and tree masks of its rounds) a token; prompts left out. "
            f"The {args.show} best of {len(grid) * len(tree_methods)} trees, then every chain:\n\n"
            "| method | shape | tau | ms per round: draft / update / verify / other | modelled tok/s | modelled speed-up |\n"
            "|---|---|---|---|---|---|\n")
    trees = [r for r in modelled if r["tree"] is not None]
    for r in trees[: args.show] + chains:
        ms = r["ms_per_round"]
        who = r["method"] + (f" ({100 * r['ngram_share']:.0f}% n-gram rounds)" if r["method"].startswith("hybrid") else "")
        body += (f"| {who} | {r['shape']} | {r['tau']:.2f} | {ms['draft']:.1f} / {ms['update']:.1f} / "
                 f"{ms['verify']:.1f} / {ms['other']:.1f} | {r['tok_s']:.1f} | {r['speedup']:.2f}x |\n")
    for method, row in best.items():
        if row is not None:
            t = row["tree"]
            body += (f"\nBest {method} tree: `{flags.get(method, f'--method {method}')} --tree --tree-depth {t['depth']} "
                     f"--tree-topk {t['topk']} --tree-total-tokens {t['total_tokens']}` (modelled {row['speedup']:.2f}x at "
                     f"tau {row['tau']:.2f}).\n")
    if args.note:
        body += "\n" + args.note + "\n"
    print(body)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "plain_s": plain_s, "recorded_plain_s": recorded_s,
                                              "context": context,
                                              "one_token_s": one, "move_s": move_cost, "rows": modelled,
                                              "block_costs": {f"{n}{'m' if m else ''}": s for (n, m), s in cost.items()}},
                                             indent=2))
    if args.table:
        write_table(args.table, args.title or f"Draft shapes replayed: {args.method} chains and trees against "
                       "n-gram lookup", body)


if __name__ == "__main__":
    main()
