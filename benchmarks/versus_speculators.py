"""EAGLE-3 training throughput, headstart against vLLM's speculators, on the same rows, steps and draft vocab, one
after the other on this machine (the suite ``python benchmarks/run.py versus-speculators`` runs the steps).

    python benchmarks/versus_speculators.py prepare --config configs/demo/eagle3_regenerated.yaml --out runs/vs-spec \\
        --train-rows 1200 --heldout-rows 100
    python benchmarks/versus_speculators.py collect --out runs/vs-spec --result benchmarks/results/versus_speculators_demo.json

``prepare`` splits the recipe's data file into train and held-out conversations (its first rows, in order), tokenizes
them with headstart's data step (so both frameworks train on the same token ids and loss masks), builds one draft
vocab from the train rows' loss-masked tokens, and writes speculators' training input: its dataset (``input_ids``,
``loss_mask``, ``seq_len``), the draft vocab as its ``d2t``/``t2d`` files, and one hidden-state file per row (the
recipe's aux layers and the last layer's output before the final norm, what speculators' vLLM step captures; here the
target's HF forward writes them, timed as speculators' data step).

``collect`` evaluates every head on the same held-out conversations with one evaluator (scripts/evaluate_head.py,
speculators' checkpoint converted to headstart's layout with export_head.py, tensors untouched), reads each run's
trained tokens, wall time and peak memory, and writes the result file.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from safetensors.torch import save_file

from headstart.benchmarks.heads_side_by_side import time_log
from headstart.benchmarks.record import write_result
from headstart.models.draft_vocab import build_draft_vocab, count_tokens
from headstart.models.target import Target, decoder_layers, load_tokenizer
from headstart.trainer.config import load_config
from headstart.trainer.data import build_dataset

ROOT = Path(__file__).resolve().parents[1]


def split_rows(source: Path, out: Path, train_rows: int, heldout_rows: int) -> tuple[Path, Path]:
    lines = [x for x in source.read_text().splitlines() if x.strip()]
    if len(lines) < train_rows + heldout_rows:
        raise SystemExit(f"{source} has {len(lines)} rows, fewer than {train_rows} + {heldout_rows}")
    train, heldout = out / "train.jsonl", out / "heldout.jsonl"
    train.write_text("\n".join(lines[:train_rows]) + "\n")
    heldout.write_text("\n".join(lines[train_rows:train_rows + heldout_rows]) + "\n")
    return train, heldout


@torch.no_grad()
def write_hidden_states(target: Target, rows: Dataset, directory: Path, first: int = 0) -> int:
    """speculators' ``hidden_states/hs_{row}.safetensors``: [seq, aux layers + 1, H], the last entry the final decoder
    layer's output before the model's norm (speculators applies the verifier's norm itself). Returns the tokens."""
    directory.mkdir(parents=True, exist_ok=True)
    last: dict[str, torch.Tensor] = {}
    hook = decoder_layers(target.model)[-1].register_forward_hook(
        lambda module, args, output: last.__setitem__("h", output[0] if isinstance(output, tuple) else output))
    tokens = 0
    try:
        for i, ids in enumerate(rows["input_ids"]):
            ids = torch.tensor(ids)[None]
            aux = target(ids).aux_hidden_states[0]  # [seq, n * H], the aux layers in ascending order
            states = torch.stack([*aux.split(target.hidden_size, dim=-1), last["h"][0]], dim=1)
            save_file({"hidden_states": states.float().contiguous(), "token_ids": ids[0]},
                      str(directory / f"hs_{first + i}.safetensors"))
            tokens += ids.shape[1]
    finally:
        hook.remove()
    return tokens


def prepare(args: argparse.Namespace) -> None:
    config = load_config(args.config, [])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train_file, heldout_file = split_rows(Path(config.data.files[0]), out, args.train_rows, args.heldout_rows)
    tokenizer = load_tokenizer(config.target.path, config.target.trust_remote_code)
    train, heldout = (build_dataset(replace(config.data, files=[str(f)], cache_dir=str(out / "cache")), tokenizer)[0]
                      for f in (train_file, heldout_file))
    target = Target.from_pretrained(config.target)
    d2t, t2d = build_draft_vocab(count_tokens(zip(train["input_ids"], train["loss_mask"]), target.vocab_size),
                                 config.draft.options.draft_vocab_size)
    spec = out / "speculators-data"
    start = time.perf_counter()
    tokens = write_hidden_states(target, train, spec / "hidden_states")
    seconds = time.perf_counter() - start
    # The held-out rows follow the train rows: speculators' --train-data-ratio (``train_ratio`` below) makes exactly
    # them its validation split, so its own held-out accuracy is read on the rows headstart's evaluator reads.
    write_hidden_states(target, heldout, spec / "hidden_states", first=len(train))
    rows = {k: list(train[k]) + list(heldout[k]) for k in ("input_ids", "loss_mask")}
    Dataset.from_dict({**rows, "seq_len": [len(x) for x in rows["input_ids"]]}).with_format("torch").save_to_disk(str(spec))
    n = config.draft.options.draft_vocab_size
    np.save(spec / f"d2t-{n}.npy", d2t.numpy().astype(np.int64))
    np.save(spec / f"t2d-{n}.npy", t2d.numpy().astype(bool))
    record = {"train_rows": len(train), "heldout_rows": len(heldout), "train_tokens": tokens,
              "train_ratio": (len(train) + 0.5) / (len(train) + len(heldout)),  # int(rows x ratio) = the train rows
              "trained_tokens": int(sum(sum(m) for m in train["loss_mask"])), "aux_layer_ids": list(target.aux_layer_ids),
              "num_layers": target.num_layers, "draft_vocab_size": n, "hidden_states_s": round(seconds, 2),
              "recipe": args.config}
    (out / "prepare.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(record))


def evaluate(recipe: str, head: Path, heldout: Path, out: Path, *flags: str) -> dict:
    """scripts/evaluate_head.py on the held-out conversations (all but one of them held out)."""
    cmd = [sys.executable, "scripts/evaluate_head.py", "--config", recipe, "--head", str(head),
           f"--data.files=[{heldout}]", f"--data.cache_dir={out / 'cache'}", "--train.eval_fraction=0.999",
           "--train.max_eval_batches=1000", "--train.batch_size=4", *flags]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(next(x for x in result.stdout.splitlines() if x.startswith("{")))


def headstart_run(run: Path) -> dict:
    """Steps, trained tokens and the training loop's seconds (each step's tokens over its logged rate; log_every=1),
    with the loop seconds up to each step (for the time to an acceptance)."""
    train = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"]
    elapsed, at = 0.0, {}
    for r in train:
        elapsed += r["tokens"] / r["tokens_per_s"]
        at[r["step"]] = elapsed
    return {"steps": train[-1]["step"], "tokens_trained": int(sum(r["tokens"] for r in train)), "loop_s": round(elapsed, 1),
            "loop_s_at": at}


def speculators_run(run: Path) -> dict:
    """The same from speculators' logged steps: the loop's seconds from each step's log time (the first step's own
    duration added); its tokens are the epoch's, every train row once."""
    train = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "train" in r]
    loop = train[-1]["time"] - train[0]["time"] + train[0]["profile"]["step_ms"] / 1000
    return {"steps": train[-1]["global_step"] + 1, "loop_s": round(loop, 1)}


def own_heldout(checkpoint: Path) -> dict:
    """speculators' own validation on the held-out rows: per-step accuracy that every earlier step also matched
    (full_acc_k), so 1 + their sum is its simulated acceptance length."""
    val = json.loads((checkpoint / "val_metrics.json").read_text())
    full = [val[k] for k in sorted((k for k in val if k.startswith("full_acc_")), key=lambda k: int(k.split("_")[2]))]
    return {"full_acc": [round(a, 4) for a in full], "sim_accept_len": round(1 + sum(full), 4)}


def collect(args: argparse.Namespace) -> None:
    out = Path(args.out)
    prepared = json.loads((out / "prepare.json").read_text())
    recipe, heldout = prepared["recipe"], out / "heldout.jsonl"
    ttt = f"--draft.ttt_steps={args.ttt}"
    spec = out / "speculators"
    checkpoint = max((p for p in (spec / "checkpoints").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    flat = out / "speculators-flat"
    subprocess.run([sys.executable, "scripts/export_head.py", "--head", str(checkpoint), "--to", "flat", "--out",
                    str(flat), "--overwrite"], cwd=ROOT, check=True)
    runs = {"speculators": {**time_log(out / "speculators.time"), **speculators_run(spec),
                            "tokens_trained": prepared["train_tokens"], "own_heldout": own_heldout(checkpoint),
                            "eval": evaluate(recipe, flat, heldout, out, ttt)}}
    goal = runs["speculators"]["eval"]["sim_accept_len"]
    for name in ("headstart-online", "headstart-offline"):
        run = out / name
        if not (run / "final").is_dir():
            continue
        record = {**time_log(out / f"{name}.time"), **headstart_run(run), "eval": evaluate(recipe, run / "final", heldout,
                                                                                          out, ttt)}
        # The first checkpoint whose held-out acceptance reaches speculators' final one, and the loop's time to it.
        for step_dir in sorted((run / "checkpoints").glob("step_*")):
            step = int(step_dir.name.split("_")[1])
            value = evaluate(recipe, step_dir / "draft", heldout, out, ttt)["sim_accept_len"]
            record.setdefault("checkpoints", {})[step] = value
            if value >= goal and "reached_at" not in record:
                record["reached_at"] = {"step": step, "loop_s": round(record["loop_s_at"][step], 1)}
        del record["loop_s_at"]
        runs[name] = record
    if (out / "features.time").is_file() and "headstart-offline" in runs:
        runs["headstart-offline"]["features"] = time_log(out / "features.time")
    for run in runs.values():
        run["sim_accept_len"] = run["eval"]["sim_accept_len"]
    for run in runs.values():  # real tokens (no padding) through the training loop: what each run trained
        run["tokens_per_s"] = round(run["tokens_trained"] / run["loop_s"], 1)
    steps, rows = runs["speculators"]["steps"], prepared["train_rows"]
    what = (f"An EAGLE-3 head (1 layer, {args.ttt} TTT steps, the {prepared['draft_vocab_size']:,}-token draft vocab of the "
            f"train rows) trained by each framework on the same {rows:,} conversations of `{prepared['recipe']}`'s data "
            f"for {steps} steps (speculators: one epoch packed into buffers of {args.seq_len} tokens, {rows / steps:.1f} "
            f"conversations a step on average; headstart: {max(1, round(rows / steps))} a step, drawn from the same "
            "rows), AdamW lr 1e-3, 3% warmup, linear decay, clip 1.0, one process on the CPU, one run after the other; "
            f"every head evaluated by scripts/evaluate_head.py on the next {prepared['heldout_rows']} conversations")
    write_result(args.result, {"title": "EAGLE-3 training throughput against vLLM's speculators", "what": what,
                               "suite": "python benchmarks/run.py versus-speculators", "prepared": prepared,
                               "training": runs}, allow_dirty=args.allow_dirty)
    print(json.dumps({k: {m: v.get(m) for m in ("tokens_per_s", "sim_accept_len", "wall_s", "peak_rss_gib")}
                      for k, v in runs.items()}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("prepare")
    a.add_argument("--config", required=True)
    a.add_argument("--out", required=True)
    a.add_argument("--train-rows", type=int, default=1200)
    a.add_argument("--heldout-rows", type=int, default=100)
    c = sub.add_parser("collect")
    c.add_argument("--out", required=True)
    c.add_argument("--result", required=True)
    c.add_argument("--seq-len", default="1024", help="speculators' --total-seq-len (said in the result's description)")
    c.add_argument("--ttt", default="3", help="the TTT steps both heads were trained and are evaluated with")
    c.add_argument("--allow-dirty", action="store_true")
    args = p.parse_args()
    prepare(args) if args.what == "prepare" else collect(args)


if __name__ == "__main__":
    main()
