"""A decode run's report: its markdown tables (by category and prompt length, where a round's time goes, the
predicted chain speed-ups), the paired comparison of two methods, the acceptance plot, the names of its shape and
mode, and the run directory it writes (results.json with the provenance a result file records: command, commit,
machine, date; results.md; acceptance.png). ``append_section`` adds a dated section to a markdown file of the
user's (``--benchmarks``). BENCHMARKS.md is not such a file: benchmarks/results_page.py generates it."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch

from headstart.decode.hybrid import ngram_share
from headstart.decode.tree import DynamicTree, OwnTree, StaticTree
from headstart.decode.verify import Verification


def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    return f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"


def command() -> str:
    """The command line that is running, as a user would type it again."""
    args = " ".join(shlex.quote(a) for a in sys.argv[1:])
    if Path(sys.argv[0]).name.split(" ")[0] == "headstart":  # the console script ("headstart NAME": scripts/cli.py)
        return f"{Path(sys.argv[0]).name} {args}".strip()
    launcher = "torchrun --nproc_per_node " + os.environ["WORLD_SIZE"] + " " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "python "
    return launcher + " ".join([shlex.quote(sys.argv[0]), args]).strip()


def commit() -> str | None:
    """The git commit of the code that runs (``-dirty`` where tracked files differ from it), or None outside a
    git checkout (an installed package)."""
    here = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str | None:
        try:
            run = subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return run.stdout.strip() if run.returncode == 0 else None

    head = git("rev-parse", "--short=12", "HEAD")
    if head is None:
        return None
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def provenance() -> dict[str, str | None]:
    """What a result file records of the run that made it: the command, the code's commit, the machine, the time."""
    return {"command": command(), "commit": commit(), "machine": machine(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def append_section(path: str | Path, title: str, body: str, measured_on: str | None = None) -> None:
    """``measured_on``: the machine that made the numbers, where another than this one (runs' results.json files
    made elsewhere)."""
    path = Path(path)
    root = Path(__file__).resolve().parents[1]
    if path.resolve() == root / "BENCHMARKS.md" or path.resolve().parent == root / "benchmarks" / "pages":
        raise ValueError(f"{path} is generated from benchmarks/results/ by benchmarks/results_page.py: write the run's "
                         "result file there (benchmarks/run.py collects it) and regenerate the pages, or name another file")
    header = "" if path.exists() else "# Benchmarks\n\nEvery section is written by the script named in it; newest last.\n"
    stamp = datetime.date.today().isoformat()
    section = f"\n## {title}\n\n- date: {stamp}\n- machine: {measured_on or machine()}\n- command: `{command()}`\n\n{body.rstrip()}\n"
    with path.open("a") as f:
        f.write(header + section)


def paired_summary(first: list[float], second: list[float], overall_ratio: float | None) -> dict:
    """Two methods timed on the same turns: the ratio of their tokens/s over all turns (``overall_ratio``, first /
    second) and turn by turn (``ratios``, in the turns' order), that ratio's median and quartiles, and how many turns
    the first was faster -- the comparison that this machine's drift between separate runs blurs."""
    ratios = [a / b for a, b in zip(first, second)]  # in turn order
    if not ratios:
        return {"turns": 0, "overall_ratio": None, "median_ratio": None, "quartiles": None, "first_faster": 0, "ratios": []}
    q = torch.tensor(ratios, dtype=torch.float64).quantile(torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)).tolist()
    return {"turns": len(ratios), "overall_ratio": overall_ratio, "median_ratio": q[1], "quartiles": [q[0], q[2]],
            "first_faster": sum(r > 1 for r in ratios), "ratios": ratios}


def paired_line(paired: dict, first: str, second: str) -> str:
    """``paired_summary`` in one sentence."""
    if not paired["turns"]:
        return ""
    lo, hi = paired["quartiles"]
    return (f"Paired in one process ({paired['turns']} turns, the two taking turns at decoding first): {first} / {second} "
            f"tokens/s {paired['overall_ratio']:.3f}x over all turns, turn by turn median {paired['median_ratio']:.3f}x "
            f"(quartiles {lo:.3f}-{hi:.3f}x); {first} faster in {paired['first_faster']} of {paired['turns']} turns.")



def split_table(results: dict) -> str:
    """Where a speculative round's time goes (overall), and the speed-up its forward costs predict."""
    r = results["overall"]
    if r.get("round_ms") is None:
        return ""
    ms = r["round_ms"]
    total = sum(ms.values())
    measured = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
    prompt = r["prompt_ms"]
    return ("| per round (ms) | draft | drafter update | target verify | other | plain forward / token | "
            "prompt per turn, speculative / plain | predicted speed-up | measured | measured / predicted |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n"
            f"| overall | {ms['draft']:.2f} ({ms['draft'] / total:.0%}) | {ms['update']:.2f} ({ms['update'] / total:.0%}) | "
            f"{ms['verify']:.2f} ({ms['verify'] / total:.0%}) | {ms['other']:.2f} ({ms['other'] / total:.0%}) | "
            f"{r['plain_forward_ms']:.2f} | {prompt['speculative']:.1f} / {prompt['plain']:.1f} | "
            f"{r['predicted_speedup']:.2f}x | {measured} | "
            + ("-" if r["speedup"] is None else f"{r['speedup'] / r['predicted_speedup']:.2f}") + " |"
            + ("" if (r.get("learn_ms_per_token") or 0) < 0.01 else  # a drafter that learns nothing: microseconds
               f"\n\nLearning from the served requests (the drafter's ``finish``: an online head's updates, an n-gram "
               f"store's counts) took {r['learn_ms_per_token']:.2f} ms a generated token, inside the measured time."))


def markdown_table(results: dict, by_prompt_length: dict | None = None) -> str:
    """One row per category, then (when given) per prompt-length bucket, then overall."""
    lines = ["| category | tau | acceptance by position | spec tok/s | plain tok/s | speed-up | HF generate tok/s |",
             "|---|---|---|---|---|---|---|"]
    rows = [(k, results[k]) for k in sorted(results) if k != "overall"]
    rows += [(f"*{k}*", v) for k, v in (by_prompt_length or {}).items()] + [("overall", results["overall"])]
    for name, r in rows:
        acc = " ".join("-" if a is None else f"{a:.2f}" for a in r["acceptance_by_position"])
        fmt = lambda x, spec="{:.1f}": "-" if x is None else spec.format(x)  # noqa: E731
        lines.append(f"| {name} | {r['tau']:.2f} | {acc} | {fmt(r['spec_tokens_per_s'])} | {fmt(r['plain_tokens_per_s'])} | "
                     f"{fmt(r['speedup'], '{:.2f}x')} | {fmt(r['hf_generate_tokens_per_s'])} |")
    return "\n".join(lines)


def plot_acceptance(results: dict, path: str | Path, title: str) -> None:
    """PNG of acceptance by draft position, one line per category (overall in bold)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in sorted(k for k in results if k != "overall") + ["overall"]:
        acc = results[name]["acceptance_by_position"]
        xs = [i + 1 for i, a in enumerate(acc) if a is not None]
        ys = [a for a in acc if a is not None]
        bold = name == "overall"
        ax.plot(xs, ys, marker="o", linewidth=2.5 if bold else 1.0, alpha=1.0 if bold else 0.6, color="black" if bold else None,
                label=f"{name} (tau {results[name]['tau']:.2f})")
    ax.set_xlabel("draft position i")
    ax.set_ylabel("share of rounds accepting >= i drafts")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_table(report: dict) -> str:
    """A run's results table and, where measured, where its rounds' time goes."""
    table = markdown_table(report["results"], report["by_prompt_length"])
    split = split_table(report["results"])
    if split:
        # what the columns mean (the round clock, the predicted speed-up): docs/DECODING.md, "What the benchmark reports"
        table += "\n\nWhere a round's time goes (ms), and the speed-up the measured forwards predict:\n\n" + split
    return table


def prediction_table(prediction: dict, overall: dict, k_run: int) -> str:
    """``--predict``'s rows (decode/measure.py ``predict_chains``): tau and speed-up of chains of k = 1..8, by the steps
    alone and with the run's measured overhead, and the k it recommends."""
    times, overhead = prediction, prediction["overhead_seconds"]
    plain_per_token = 1.0 / overall["plain_tokens_per_s"]
    text = ("Predicted from the acceptance above and step times measured at the first prompt (target forward "
            f"of 1 token: {times['verify_seconds'][0] * 1e3:.2f} ms). 'steps only' counts the k draft steps and the "
            f"verify forward; 'with overhead' adds the rest of a round ({overhead * 1e3:.2f} ms: drafter update, "
            f"verification, bookkeeping), calibrated from this run's measured time per round at k={k_run}, and "
            f"costs plain decoding at its measured {plain_per_token * 1e3:.2f} ms per token:\n\n"
            "| k | predicted tau | draft k steps (ms) | verify k+1 tokens (ms) | speed-up, steps only | "
            "speed-up, with overhead |\n|---|---|---|---|---|---|\n")
    text += "\n".join(f"| {r['k']} | {r['tau']:.2f} | {times['draft_seconds'][r['k'] - 1] * 1e3:.2f} | "
                      f"{times['verify_seconds'][r['k']] * 1e3:.2f} | {b['speedup']:.2f}x | {r['speedup']:.2f}x |"
                      for r, b in zip(prediction["rows"], prediction["rows_steps_only"]))
    return text + f"\n\nRecommended k: **{prediction['recommended_k']}**."


def run_shape(k: int, tree: DynamicTree | StaticTree | None) -> str:
    """What a round drafts, as tables name it: a chain of k, a static tree's paths, or a dynamic tree's size."""
    if tree is None:
        return f"chain k={k}"
    if isinstance(tree, StaticTree):
        return f"static tree of {len(tree.paths)} paths"
    if isinstance(tree, OwnTree):
        return tree.about
    return f"dynamic tree depth {tree.depth} top-k {tree.topk} {tree.total_tokens} tokens"


def run_mode(args, dtype: str, default_dtype: str, compiled_drafter: bool = False, learned_tokens: int | None = None,
             hybrid_rounds: dict[str, int] | None = None, pads: dict[int, int] | None = None) -> str:
    """How a run decoded, as tables name it, from ``headstart bench``'s flags (``args``) and what only the run knows:
    the dtype (said where it is not the device's default), whether the drafter compiled too, the tokens a learning
    n-gram store took in, a hybrid's rounds by drafter, the block sizes a chain was padded to."""
    mode = (f"sampling T={args.temperature} top-p {args.top_p} top-k {args.top_k}" if args.temperature > 0 else "greedy")
    rule = Verification(args.verification, args.typical_threshold, args.typical_alpha).describe()
    if rule:
        mode += f", {rule}"
    if args.confidence_threshold:
        mode += f", stop under p {args.confidence_threshold:g}"
    if args.ngram_learn:
        mode += f", the store learning each reply ({learned_tokens} tokens learned)"
    if hybrid_rounds is not None:
        mode += f", n-gram lookup first from {args.hybrid_ngram:g} expected ({100 * ngram_share(hybrid_rounds):.0f}% of rounds)"
        if args.hybrid_model_tree:
            mode += ", the model's trees depth {} top-{} {} tokens".format(*args.hybrid_model_tree)
    if pads is not None:
        mode += ", blocks padded (" + (" ".join(f"{n}->{m}" for n, m in pads.items() if m != n) or "none") + ")"
    if args.batch_size > 1:
        mode += f", batch {args.batch_size}"
    if dtype != default_dtype:
        mode += f", {dtype}"
    if args.compile:
        mode += ", compiled target and drafter" if compiled_drafter else ", compiled target"
    return mode


def write_results(out: str | Path, args: dict, report: dict, shape: str, mode: str, table: str, title: str) -> None:
    """A run directory: results.json (the flags, the command, commit, machine and date, the shape and mode, the
    report), results.md (the table) and acceptance.png (titled ``title``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": args, **provenance(), "shape": shape, "mode": mode, **report},
                                                 indent=2))
    (out / "results.md").write_text(table + "\n")
    plot_acceptance(report["results"], out / "acceptance.png", f"{title}, {shape}, {mode}")
