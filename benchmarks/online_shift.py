"""A head served a domain it was not trained on, frozen against learning online (``--online``), on one stream of
requests in one process (the suite ``python benchmarks/run.py online-shift`` runs the steps).

    python benchmarks/online_shift.py prepare --regenerated runs/demo-regenerated/regenerated.jsonl --out runs/online-shift
    python benchmarks/online_shift.py collect --out runs/online-shift --learning lr3e-4-every4 \
        --result benchmarks/results/online_shift_demo.json

``prepare`` writes the training rows of one source only (the target's own replies to GSM8K questions, from the demo's
regenerated data) and two question files in MT-bench's format: the shifted stream (GPTeacher codegen and roleplay
prompts taken in turn, past the rows any demo head trained on) and held-out GSM8K questions (past the training rows).

``collect`` reads every online run in the directory (``stream-NAME``: the stream decoded by the frozen head and by one
learning head, ``headstart bench --versus``: the same prompts in the same order, paired turn by turn; the suite's own
setting is ``--learning NAME``): tau per window of 20 requests, the last half's ratio, the paired speed-up with the
updates' time inside it (over the stream and its last half), their cost per token, the settings read from the run's
command; and the original domain's held-out questions decoded by the head as it started and as it ended each stream
(``original-NAME``, from ``--online-save``).
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from headstart.benchmarks.record import write_result
from headstart.decode.questions import prompt_ids
from headstart.models.target import load_tokenizer
from headstart.trainer.config import TrainConfig, load_config
from headstart.trainer.conversations import detect_format, to_messages

SHIFTED = ("configs/demo/data/gpteacher_codegen.json", "configs/demo/data/gpteacher_roleplay.json")
ORIGINAL = "configs/demo/data/gsm8k_train.jsonl"
TRAINED_ROWS = 500
"""Rows of each source file the demo's regenerated data (and so every demo head) was made from: the prompts after
them are new to every head."""


def first_user_turn(row: dict) -> str:
    return to_messages(row, detect_format(row))[0]["content"]


def read_rows(path: str) -> list[dict]:
    text = Path(path).read_text()
    return json.loads(text) if path.endswith(".json") else [json.loads(line) for line in text.splitlines() if line.strip()]


def write_questions(path: Path, prompts: list[tuple[str, str]], first_id: int) -> None:
    path.write_text("".join(json.dumps({"question_id": first_id + i, "category": category, "turns": [text]}) + "\n"
                            for i, (category, text) in enumerate(prompts)))


def prepare(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in Path(args.regenerated).read_text().splitlines() if line.strip()]
    kept = [r for r in rows if r["source"]["file"] == ORIGINAL]
    if not kept:
        raise SystemExit(f"{args.regenerated} holds no rows regenerated from {ORIGINAL}")
    (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    sources = [read_rows(p)[TRAINED_ROWS:] for p in SHIFTED]
    half = args.stream // len(SHIFTED)
    stream = [(Path(p).stem.split("_")[-1], first_user_turn(rows_[i])) for i in range(half)
              for p, rows_ in zip(SHIFTED, sources)]
    write_questions(out / "shifted.jsonl", stream, 10_000)
    after = [(Path(p).stem.split("_")[-1], first_user_turn(rows_[half + i])) for i in range(args.heldout // len(SHIFTED))
             for p, rows_ in zip(SHIFTED, sources)]
    write_questions(out / "shifted_heldout.jsonl", after, 30_000)
    heldout = read_rows(ORIGINAL)[TRAINED_ROWS:TRAINED_ROWS + args.heldout]
    write_questions(out / "original.jsonl", [("gsm8k", first_user_turn(r)) for r in heldout], 20_000)
    print(f"{len(kept)} training rows from {ORIGINAL}; a stream of {len(stream)} shifted prompts; {len(heldout)} held-out "
          f"questions of the original domain -> {out}")


def write_log(args: argparse.Namespace) -> None:
    """Regenerated conversations (the target's own replies; of ``--source-file`` only, where given) as a server's
    request log: one OpenAI chat completion per assistant turn, with vLLM's prompt token ids, rendered by the target's
    tokenizer and chat template. For the demo: its regenerated codegen and roleplay rows, which the GSM8K-only head
    never saw."""
    tokenizer = load_tokenizer(args.target)
    rows = [json.loads(line) for line in Path(args.regenerated).read_text().splitlines() if line.strip()]
    served = [r for r in rows if not args.source_file or r["source"]["file"] in args.source_file]
    n = 0
    with Path(args.log).open("w") as f:
        for r in served:
            for i, reply in enumerate(r["messages"]):
                if reply["role"] != "assistant":
                    continue
                prompt = r["messages"][:i]
                f.write(json.dumps({"request": {"model": args.target, "messages": prompt},
                                    "response": {"choices": [{"index": 0, "message": reply}],
                                                 "prompt_token_ids": prompt_ids(tokenizer, prompt)[0].tolist()}}) + "\n")
                n += 1
    print(f"{n} served completions from {len(served)} conversations -> {args.log}")


def mtbench_prompts(args: argparse.Namespace) -> None:
    """MT-bench-style traffic to serve: every MT-bench question but the first of each category (those are the
    held-out questions every MT-bench table here decodes: ``--per-category 1``), as conversations whose assistant
    turns the target rewrites (``headstart regenerate``): both turns once, and the first turn ``--samples`` - 1 more
    times (a server sees the same kind of question again)."""
    questions = [json.loads(line) for line in Path(args.questions).read_text().splitlines() if line.strip()]
    seen: set[str] = set()
    rows = []
    for q in questions:
        if q["category"] not in seen:
            seen.add(q["category"])
            continue
        both = [m for text in q["turns"] for m in ({"role": "user", "content": text},
                                                   {"role": "assistant", "content": "(served reply)"})]
        rows += [both] + [both[:2]] * (args.samples - 1)
    Path(args.out).write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    print(f"{len(rows)} conversations from {len(questions) - len(seen)} MT-bench questions -> {args.out}")


def windows(turns: list[list[float]], size: int) -> list[float]:
    """tau of each window of ``size`` consecutive requests: its counted tokens over its target forwards."""
    return [sum(t[0] for t in turns[i:i + size]) / max(1, sum(t[1] for t in turns[i:i + size]))
            for i in range(0, len(turns), size)]


def tau_of(turns: list[list[float]]) -> float:
    return sum(t[0] for t in turns) / max(1, sum(t[1] for t in turns))


def speed(turns: list[list[float]]) -> float:
    return sum(t[2] for t in turns) / sum(t[3] for t in turns)


def overall_tau(out: Path, name: str) -> float | None:
    path = out / name / "results.json"
    return json.loads(path.read_text())["results"]["overall"]["tau"] if path.is_file() else None


def learner_row(frozen: dict, learner: dict, original_after: float | None, original_before: float) -> dict:
    """One way of serving the stream: its tau (all, by window, the last half), tokens/s with the updates inside, their
    cost, and the original domain's held-out tau after it."""
    half = len(learner["turns"]) // 2
    turns = learner["turns"]
    return {"tau": tau_of(turns), "windows": windows(turns, WINDOW), "last_half_tau": tau_of(turns[half:]),
            "last_half_vs_frozen": tau_of(turns[half:]) / tau_of(frozen["turns"][half:]),
            "tokens_per_s": speed(turns), "last_half_tokens_per_s": speed(turns[half:]),
            # against the frozen head decoded turn by turn beside it, in the same process
            "speed_vs_frozen": speed(turns) / speed(frozen["turns"]),
            "last_half_speed_vs_frozen": speed(turns[half:]) / speed(frozen["turns"][half:]),
            "learn_ms_per_token": learner["results"]["overall"].get("learn_ms_per_token"), "mode": learner.get("mode"),
            "greedy_exact": not learner.get("mismatches"), "original_tau_after": original_after,
            "original_change": None if original_after is None else original_after / original_before - 1.0}


WINDOW = 20
"""Requests per window of the stream's tau."""


def learning_settings(command: str) -> dict:
    """How a stream's online head learned, from the stream's recorded ``headstart bench`` command (its --versus flags):
    learning rate (without --online-lr, the --online-recipe's), update interval, steps per update, replay or not."""
    words = shlex.split(command)
    flags = shlex.split(words[words.index("--versus") + 1])
    value = lambda flag: flags[flags.index(flag) + 1] if flag in flags else None  # noqa: E731
    recipe = value("--online-recipe")
    lr = value("--online-lr") or (load_config(recipe).train if recipe else TrainConfig()).lr
    return {"lr": float(lr), "every": int(value("--online-every")), "steps": int(value("--online-steps")),
            "replay": "--online-replay" in flags}


def collect(args: argparse.Namespace) -> None:
    """Every online run in ``--out`` (``stream-NAME``: the frozen head paired with one learning; ``original-NAME``: the
    original domain after it), the suite's own setting (``--learning``) and its run without replay first."""
    out = Path(args.out)
    main = json.loads((out / f"stream-{args.learning}" / "results.json").read_text())
    before = overall_tau(out, "original-frozen")
    rows = {"frozen": learner_row(main, main, before, before)}
    names = [p.parent.parent.name.removeprefix("stream-") for p in out.glob("stream-*/versus/results.json")]
    first = [n for n in (args.learning, f"noreplay-{args.learning}") if n in names]
    for name in first + sorted(set(names) - set(first)):
        beside = json.loads((out / f"stream-{name}" / "results.json").read_text())  # its own paired frozen run
        learner = json.loads((out / f"stream-{name}" / "versus" / "results.json").read_text())
        rows[name] = {**learner_row(beside, learner, overall_tau(out, f"original-{name}"), before),
                      **learning_settings(beside["command"]), "command": beside["command"]}
    record = {
        "title": "A head served another domain: frozen, learning online, adapted from a log",
        "what": "the demo target's EAGLE-3 head trained on its GSM8K replies only (600 steps), served GPTeacher codegen "
                "and roleplay prompts it never saw, in chains of 4, greedy (every output the target's), 128 new tokens",
        "suite": "python benchmarks/run.py online-shift",
        "online": {"requests": len(main["turns"]), "window": WINDOW, "runs": rows, "learning": args.learning,
                   "paired": main.get("paired"),
                   "original_questions": len(json.loads((out / "original-frozen" / "results.json").read_text())["turns"]),
                   "train": args.train_command},
    }
    if (out / "adapt" / "run" / "run_config.json").is_file():
        config = json.loads((out / "adapt" / "run" / "run_config.json").read_text())
        record["online"]["adapt"] = {
            "log_completions": sum(1 for _ in (out / "served-log.jsonl").open()),
            "steps": config["train"]["max_steps"], "files": config["data"]["files"],
            "held_out_questions": len(json.loads((out / "new-frozen" / "results.json").read_text())["turns"]),
            "new_domain": {"frozen": overall_tau(out, "new-frozen"), "adapted": overall_tau(out, "new-adapt"),
                           "from_scratch": overall_tau(out, "new-scratch")},
            "original_domain": {"frozen": before, "adapted": overall_tau(out, "original-adapt")}}
    write_result(args.result, record, args.allow_dirty)
    print(json.dumps({k: {m: v for m, v in r.items() if m != "windows"} for k, r in rows.items()}, indent=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    pre = sub.add_parser("prepare")
    pre.add_argument("--regenerated", required=True, help="the demo's regenerated conversations (regenerated.jsonl)")
    pre.add_argument("--out", required=True)
    pre.add_argument("--stream", type=int, default=240, help="shifted requests, half codegen and half roleplay")
    pre.add_argument("--heldout", type=int, default=40, help="held-out questions of each domain")
    log = sub.add_parser("log")
    log.add_argument("--regenerated", required=True)
    log.add_argument("--target", required=True)
    log.add_argument("--log", required=True)
    log.add_argument("--source-file", nargs="*", default=None, help="only the rows regenerated from these files")
    mt = sub.add_parser("mtbench-prompts")
    mt.add_argument("--questions", required=True)
    mt.add_argument("--out", required=True)
    mt.add_argument("--samples", type=int, default=2)
    col = sub.add_parser("collect")
    col.add_argument("--out", required=True)
    col.add_argument("--result", required=True)
    col.add_argument("--learning", required=True, metavar="NAME",
                     help="the suite's own online setting (its runs: stream-NAME, original-NAME, stream-noreplay-NAME)")
    col.add_argument("--train-command", default="", help="how the head was trained (for the record)")
    col.add_argument("--allow-dirty", action="store_true")
    args = p.parse_args(argv)
    {"prepare": prepare, "log": write_log, "mtbench-prompts": mtbench_prompts, "collect": collect}[args.command](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
