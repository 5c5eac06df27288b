"""One table from several ``headstart bench`` runs (their ``results.json``): tau, acceptance by position, tokens/s
and speed-up per method and batch size, side by side, each run's shape and mode as it named them; printed, and with
``--table FILE`` written there with the runs' setting and provenance. Batched runs' tokens/s are over the whole batch.

    python benchmarks/compare_methods.py runs/bench-medusa-chain runs/bench-eagle3-chain ... --table runs/heads.md \
        --title "Heads side by side" --note "why the ranking comes out as it does"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from headstart.decode.report import paired_line
from headstart.benchmarks.record import write_table


def draft(args: dict) -> str:
    """The draft's directory and/or n-gram lookup's datastore files (decode/ngram_store.py; a hybrid has both), or '-'."""
    store = "store: " + ", ".join(f"`{path}`" for path in args["ngram_store"]) if args.get("ngram_store") else ""
    if args.get("draft"):
        return f"`{args['draft']}`" + (f" + {store}" if store else "")
    return store or "`-`"


def split(r: dict) -> str:
    """A round's milliseconds by part and the speed-up its forward costs predict (decode/clock.py); '-' for runs
    without a split (transformers' own loops, or runs made before the split existed)."""
    ms = r.get("round_ms")
    if not ms:
        return "- | - | - | -"
    prompt = r.get("prompt_ms")  # runs made before it was recorded: '-'
    return (f"{ms['draft']:.1f} / {ms['update']:.1f} / {ms['verify']:.1f} / {ms['other']:.1f} | "
            + ("-" if not prompt else f"{prompt['speculative']:.1f} / {prompt['plain']:.1f}") + " | "
            f"{r['predicted_speedup']:.2f}x | {r['speedup'] / r['predicted_speedup']:.2f}")


def table(runs: list[Path]) -> str:
    lines = ["| method | draft | shape | mode | batch | tau | acceptance by position | spec tok/s | plain tok/s | speed-up | "
             "round ms: draft / update / verify / other | prompt ms per turn: speculative / plain | predicted speed-up | "
             "measured / predicted |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        report = json.loads((run / "results.json").read_text())
        a, r = report["args"], report["results"]["overall"]
        acc = " ".join("-" if x is None else f"{x:.2f}" for x in r["acceptance_by_position"][:6]) or "-"
        lines.append(f"| {a['method']} | {draft(a)} | {report['shape']} | {report['mode']} | {a.get('batch_size', 1)} | "
                     f"{r['tau']:.2f} | {acc} | "
                     f"{r['spec_tokens_per_s']:.1f} | {r['plain_tokens_per_s']:.1f} | {r['speedup']:.2f}x | {split(r)} |")
    return "\n".join(lines)


def paired_notes(runs: list[Path]) -> str:
    """For each run made with --versus: its turn-by-turn comparison with the second method (OUT/versus)."""
    notes = []
    for run in runs:
        report = json.loads((run / "results.json").read_text())
        if report.get("paired"):  # the second method's run directory is OUT/versus (headstart bench --versus)
            second = json.loads((run / "versus" / "results.json").read_text())["args"]["method"]
            notes.append(f"`{run}` and `{run / 'versus'}`: "
                         + paired_line(report["paired"], report["args"]["method"], second))
    return "".join("\n\n" + n for n in notes)


def measured_on(runs: list[Path], given: str | None) -> str | None:
    """The one machine the runs' results.json files name (None: this one, for runs that name none); runs from
    different machines are refused, a table compares only numbers from one."""
    named = {json.loads((r / "results.json").read_text()).get("machine") for r in runs} - {None}
    if len(named) > 1:
        raise SystemExit(f"compare_methods.py: the runs were made on different machines: {sorted(named)}")
    if given and named and given not in named:
        raise SystemExit(f"compare_methods.py: --machine {given!r} but the runs name {named.pop()!r}")
    return given or (named.pop() if named else None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="--out directories of headstart bench runs")
    p.add_argument("--table", default=None, help="write the table to this markdown file")
    p.add_argument("--title", default="Drafters side by side")
    p.add_argument("--note", default="", help="a sentence placed under the table")
    p.add_argument("--script", default=None, help="the command that made the runs (e.g. `python benchmarks/run.py batch`)")
    p.add_argument("--machine", default=None,
                   help="the machine the runs were made on, for runs whose results.json does not record it")
    args = p.parse_args()
    paired = paired_notes(args.runs)
    text = table(args.runs) + paired
    print(text)
    if args.table:
        first = json.loads((args.runs[0] / "results.json").read_text())["args"]
        setting = (f"`{first['questions']}`, {'first ' + str(first['per_category']) + ' per category' if first.get('per_category') else 'all'}"
                   f" (all turns), max {first['max_new_tokens']} new tokens, "
                   f"target `{first['target']}`, each run a separate `headstart bench` run in one sequence with nothing else "
                   f"running{f' ({args.script})' if args.script else ''}; speed-up = plain / speculative time on the same "
                   "runner.")
        if paired:
            setting += (" A run's `versus` directory is the second method of the same process (`--versus`), its plain "
                        "decoding the first method's, on the first method's runner.")
        write_table(args.table, args.title, setting + "\n\n" + text + ("\n\n" + args.note if args.note else ""),
                    measured_on=measured_on(args.runs, args.machine))


if __name__ == "__main__":
    main()
