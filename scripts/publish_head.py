"""Copy a run's head into a self-contained directory with its eval metrics and a card.

    python scripts/publish_head.py --run runs/demo-eagle3-full --out configs/demo/eagle3-head

By default the run's ``best/`` head (the evaluation with the highest decode tau, or simulated
acceptance length without decode evaluation) when the run kept one, else ``final/``; ``--head final``
publishes the last one.
"""

from __future__ import annotations

import argparse
import sys
import json
import shlex
import shutil
from pathlib import Path

from headstart.heads.exports import check_readable, detect_layout
from headstart.models.errors import UserError
from headstart.models.files import check_out_dir, claim_dir, share_like_umask
from headstart.heads.registry import HEADS, option_names
from headstart.trainer.checkpoint import latest_checkpoint
from headstart.trainer.run_dir import BEST_RECORD
from headstart.trainer.config import load_config, to_dict
from headstart.decode.report import append_section
from headstart.scripts.command import entry_point, refusals

COLUMNS = {"acc": "top-1 accuracy (draft argmax = target argmax)", "top5": "top-5 accuracy (target argmax in draft top-5)",
           "accept": "expected acceptance sum min(p, q)"}


def recipe_line(draft: dict) -> str:
    """The head's options and its loss (what a reader of the card cannot tell from the weights)."""
    names = ["loss", *option_names(draft["head"])] if "loss" in draft else option_names(draft["head"])
    return f"{draft['head']}: " + ", ".join(f"{k} {draft[k]}" for k in names)


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


RESOLVED_AT_START = {"target.aux_layer_ids"}
"""Settings a recipe may leave unset (None) that the trainer fills in at start: the run's value is not an override."""


def overrides_of(recipe: str, run_config: dict) -> list[str]:
    """The ``--section.key=value`` flags (shell-quoted, values in YAML) that turn ``recipe`` into the run's config:
    what the card's command needs to train this head again. The output directory and logging are left out."""
    planned = _flat(json.loads(json.dumps(to_dict(load_config(recipe)))))  # tuples -> lists, as run_config.json
    ran = _flat(run_config)
    flags = []
    for key in sorted(ran):
        if key == "output_dir" or key.startswith("logging.") or ran[key] == planned.get(key):
            continue
        if planned.get(key) is None and key in RESOLVED_AT_START:
            continue
        value = json.dumps(ran[key]) if isinstance(ran[key], (list, dict)) or ran[key] is None else str(ran[key])
        flags.append(shlex.quote(f"--{key}={value}"))
    return flags


def run_config_steps(run: Path) -> int:
    return json.loads((run / "run_config.json").read_text())["train"]["max_steps"]


@refusals
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="output_dir of a finished training run")
    p.add_argument("--out", required=True)
    p.add_argument("--recipe", default=None, help="the recipe YAML the run was trained with (for the record)")
    p.add_argument("--benchmarks", default=None, help="also append the eval numbers to this markdown file")
    p.add_argument("--head", choices=["best", "final"], default=None,
                   help="which of the run's heads (default: best/ when the run kept one, else final/)")
    p.add_argument("--overwrite", action="store_true",
                   help="move what --out holds aside (to <out>.old-<time>) and write there")
    args = p.parse_args(argv)
    run, out = Path(args.run), Path(args.out)
    which = args.head or ("best" if (run / "best" / "model.safetensors").is_file() else "final")
    final = run / which
    if not (final / "model.safetensors").is_file():
        raise UserError(f"--run {run}: {final} has no exported draft; did the run finish?")
    check_readable(final, "--run")
    check_out_dir(out, "--out", args.overwrite, [final])  # never over the run's own head, nor above it
    if not (run / "metrics.jsonl").is_file():
        raise UserError(f"--run {run}: no metrics.jsonl; give a training run's output_dir")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["split"] == "eval"]
    if not evals:
        raise UserError(f"--run {run}: {run}/metrics.jsonl has no eval records; publish a run that evaluated its head")
    chosen = ""
    if which == "best":  # the card describes the evaluation the head was chosen at
        best = json.loads((final / BEST_RECORD).read_text())
        evals = [r for r in evals if r["step"] <= best["step"]]
        chosen = (f" Chosen as the run's best head: step {best['step']} of {run_config_steps(run)}, by "
                  f"{'decode tau' if best['metric'] == 'decode_tau' else 'simulated acceptance length'} "
                  f"{best['value']:.3f}.")
    world = json.loads((latest_checkpoint(run) / "trainer_state.json").read_text())["world_size"]
    recipe = args.recipe or f"{run}/run_config.json (resolved)"
    claim_dir(out, "--out", args.overwrite, [final])
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(final.iterdir()):  # the export's files (headstart.json: the target it was trained for; a draft
        if path.is_file() and path.name != BEST_RECORD:  # model's tokenizer), not the run's record of its best step
            shutil.copy2(path, out / path.name)
    share_like_umask(out)  # copy2 keeps a file's mode: a checkpoint written 0600 would stay unreadable to a server
    run_config = json.loads((run / "run_config.json").read_text())
    command = f"torchrun --nproc_per_node {world} scripts/train_eagle3.py --config {recipe}"
    if args.recipe:
        command = " ".join([command, *overrides_of(args.recipe, run_config)])
    (out / "eval_metrics.json").write_text(json.dumps({"evals": evals, "run_config": run_config}, indent=2))
    last = evals[-1]
    steps = sorted(int(k.split("_")[1]) for k in last if k.startswith("acc_"))
    columns = [c for c in COLUMNS if f"{c}_0" in last]
    found = detect_layout(final)
    if found is None:
        raise UserError(f"--run {run}: {final} is not an export of a registered head ({sorted(HEADS)})")
    spec = HEADS[found[0]]
    title, layout, unit = spec.title, spec.cards[found[1]], spec.unit
    header = f"| {unit} | " + " | ".join(COLUMNS[c] for c in columns) + " |\n|---|" + "---|" * len(columns)
    rows = "\n".join(f"| {k} | " + " | ".join(f"{last[f'{c}_{k}']:.3f}" for c in columns) + " |" for k in steps)
    t = run_config["train"]
    target_name = Path(run_config["target"]["path"]).name
    features = run_config.get("features", {}).get("path")
    how = f"from features stored in `{features}` (offline)" if features else "online"
    (out / "README.md").write_text(f"""# {title} for {target_name}

{layout} Trained {how} against `{run_config['target']['path']}` by

```bash
{command}
```

{t['max_steps']} steps x {t['batch_size']} sequences x {world} ranks, {t.get('optimizer', 'adamw')}, lr {t['lr']} ({t.get('schedule', 'cosine')}),
{recipe_line(run_config['draft'])}.
Held-out evaluation at step {last['step']} ({run_config['train']['eval_fraction']:.0%} of the conversations): loss
{last['loss']:.3f}, simulated acceptance length **{last['sim_accept_len']:.3f}** (a greedy chain's tokens per target
forward under teacher forcing, bonus token included).{chosen}

{header}
{rows}

All eval records: `eval_metrics.json`.
""")
    print(f"published {final} -> {out}: sim accept len {last['sim_accept_len']:.3f}{chosen}")
    if args.benchmarks:
        body = (f"Held-out evaluation of `{out}` at step {last['step']}, trained by "
                f"`{command}` ({t['max_steps']} steps, batch {t['batch_size']}/rank, {t.get('optimizer', 'adamw')}, lr {t['lr']}); "
                f"eval loss {last['loss']:.3f}, simulated acceptance length **{last['sim_accept_len']:.3f}** "
                "(a greedy chain's tokens per target forward under teacher forcing).\n\n"
                + header + "\n" + rows + "\n")
        append_section(args.benchmarks, f"{title} for {target_name}: per-step accuracy", body)


if __name__ == "__main__":
    sys.exit(entry_point(main))
