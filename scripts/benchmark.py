"""Measure a drafter on Spec-Bench-format questions: tau, per-position acceptance, speed-up.

    python scripts/benchmark.py --target configs/demo/target --method eagle3 --draft configs/demo/eagle3-head \
        --questions configs/demo/eval/mt_bench.jsonl --num-speculative-tokens 4 --max-new-tokens 128 \
        --verify-greedy --out runs/bench-eagle3

    python scripts/benchmark.py ... --method draft-model --draft configs/demo/draft-model --tree --temperature 0.7

--tree drafts an EAGLE-2 dynamic tree (--tree-depth/--tree-topk/--tree-total-tokens) or, with --tree-paths
FILE.json, a static tree from a list of rank paths; --method ngram --tree grows a tree of what followed the context's
suffixes (decode/ngram.py). --hybrid-ngram SCORE puts n-gram lookup (with --ngram-store) in front of a model drafter: it
drafts a round where it expects SCORE accepted drafts, the model elsewhere (decode/hybrid.py). --temperature > 0 samples (lossless rejection sampling);
the default is greedy. --batch-size B decodes B questions' turns together (chains): tau per sequence, tokens/s over the batch.
--predict also times draft and target steps and predicts the speed-up of chains of
k = 1..8 from the measured acceptance (run it with --num-speculative-tokens 8 so every position is measured).
--versus 'FLAGS' decodes a second method on every turn in the same process (e.g. --versus '--method hf-prompt-lookup'),
the two taking turns at going first, and compares their tokens/s turn by turn: on a machine whose speed drifts between
runs, the comparison two separate runs cannot make.
Writes results.json, results.md and acceptance.png to --out (the second method's to OUT/versus); --benchmarks FILE also
appends the table there.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from headstart.decode.generate import Sampling
from headstart.decode.hf_peers import HFSpeculation
from headstart.decode.hybrid import HybridDrafter
from headstart.decode.lookahead import LookaheadParams
from headstart.decode.measure import Rival, predict_chains, run_benchmark
from headstart.decode.methods import MethodContext, MethodError
from headstart.decode.ngram import NgramDrafter
from headstart.decode.ngram_store import NgramStore
from headstart.decode.rest import Datastore
from headstart.decode.suffix import SuffixParams
from headstart.decode.questions import DecodeSetup, decode_setup, default_dtype, prompt_ids, read_questions
from headstart.decode.report import (append_section, paired_line, prediction_table, run_mode, run_shape, run_table,
                                     write_results)
from headstart.decode.shapes import compiled_block, draft_tree, precompile_runner
from headstart.decode.target_runner import RaggedRunner, TargetRunner
from headstart.decode.tree import DynamicTree, StaticTree
from headstart.decode.verify import RULES, Verification
from headstart.models.head import DEFAULT_SPECULATIVE_TOKENS
from headstart.trainer.ngram_corpus import ngram_store_from_conversations
from headstart.heads.methods import drafting_methods
from headstart.heads.registry import head_spec
from headstart.heads.exports import check_draft, check_readable, trained_depth
from headstart.models.errors import UserError
from headstart.models.files import check_out_dir, claim_dir
from headstart.models.provenance import check_target
from headstart.scripts.command import check_at_least, entry_point, refusals
from headstart.scripts.online_args import add_online_args, online_learner, online_refusal, save_learned
from headstart.trainer.online import OnlineLearner


SHARED = ("target", "questions", "limit", "per_category", "dtype", "max_new_tokens", "temperature", "top_p", "top_k",
          "seed", "verify_greedy", "no_hf_reference", "batch_size", "benchmarks")
"""What the method of ``--versus`` shares with the first: the target, the questions and how they are decoded."""


def add_method_args(p: argparse.ArgumentParser) -> None:
    """The drafting method's flags: which drafter, its shape, n-gram lookup, compilation (``build_method`` reads them)."""
    methods = drafting_methods()  # every --method: the heads of the catalog, then the other methods
    p.add_argument("--method", choices=list(methods), required=True,
                   help="; ".join(f"{name}: {m.help}" for name, m in methods.items()))
    p.add_argument("--draft", help="the head's exported directory, or the draft model's HF directory")
    p.add_argument("--max-len", type=int, default=None,
                   help="KV cache length of the target and drafter (default: the target's max_position_embeddings)")
    p.add_argument("--num-speculative-tokens", type=int, default=DEFAULT_SPECULATIVE_TOKENS)
    p.add_argument("--tree", action="store_true", help="draft a dynamic (EAGLE-2) tree instead of a chain")
    p.add_argument("--tree-depth", type=int, default=DynamicTree.depth)
    p.add_argument("--tree-topk", type=int, default=DynamicTree.topk)
    p.add_argument("--tree-total-tokens", type=int, default=DynamicTree.total_tokens)
    p.add_argument("--tree-paths", help="JSON file with a static tree: a list of rank paths, e.g. [[0], [1], [0, 0]]")
    p.add_argument("--allow-other-target", action="store_true",
                   help="run a head whose headstart.json names another target (warns instead of refusing)")
    p.add_argument("--ngram-max", type=int, default=3,
                   help="--method ngram or --hybrid-ngram: the longest context suffix looked up (vLLM's prompt_lookup_max)")
    p.add_argument("--hybrid-ngram", type=float, default=None, metavar="SCORE",
                   help="a head or --method draft-model with n-gram lookup first (SuffixDecoding's hybrid, "
                        "decode/hybrid.py): a round where n-gram lookup's drafts expect at least SCORE accepted (the sum of "
                        "their path probabilities under its counts) verifies them and runs no model; add --ngram-store")
    p.add_argument("--hybrid-model-tree", type=int, nargs=3, default=None, metavar=("DEPTH", "TOPK", "TOKENS"),
                   help="--hybrid-ngram with --tree: the model's own EAGLE-2 tree in the rounds it drafts (default: the "
                        "--tree shape n-gram lookup grows), of at most --tree-total-tokens")
    p.add_argument("--ngram-learn", action="store_true",
                   help="--method ngram or --hybrid-ngram: the datastore (empty without --ngram-store) also counts every "
                        "reply decoded, for the turns after it (SuffixDecoding's global tree growing as it serves)")
    p.add_argument("--ngram-store", nargs="+", default=None, metavar="FILE",
                   help="--method ngram or --hybrid-ngram: conversation files (e.g. the target's regenerated replies) whose assistant "
                        "turns n-gram lookup consults where the request's own tokens match a shorter suffix or none (decode/ngram_store.py)")
    p.add_argument("--datastore", default=None, metavar="DIR",
                   help="--method rest (or suffix: a source besides its trees): REST's datastore (`headstart datastore "
                        "--config RECIPE --output DIR` builds it)")
    suffix = SuffixParams()
    p.add_argument("--suffix-max-depth", type=int, default=suffix.max_depth,
                   help="--method suffix: the suffix trees' depth, longest match plus draft (vLLM's max_tree_depth)")
    p.add_argument("--suffix-spec-factor", type=float, default=suffix.spec_factor,
                   help="--method suffix: drafts per matched token, at most k (vLLM's max_spec_factor)")
    p.add_argument("--suffix-spec-offset", type=float, default=suffix.spec_offset,
                   help="--method suffix: drafts granted besides them")
    p.add_argument("--suffix-min-prob", type=float, default=suffix.min_prob,
                   help="--method suffix: a draft whose estimated probability is under this ends the drafts "
                        "(vLLM's min_token_prob)")
    p.add_argument("--suffix-max-cached", type=int, default=suffix.max_cached,
                   help="--method suffix: replies the global tree holds, oldest out first; 0: none (vLLM's "
                        "max_cached_requests)")
    look = LookaheadParams()
    p.add_argument("--lookahead-window", type=int, default=look.window,
                   help="--method lookahead: W, the positions its Jacobi window guesses ahead (the reference's WINDOW_SIZE)")
    p.add_argument("--lookahead-ngram", type=int, default=look.ngram,
                   help="--method lookahead: N, the n-grams' length (its window's levels + 1; a guess drafts N - 1 "
                        "tokens: the reference's LEVEL)")
    p.add_argument("--lookahead-guesses", type=int, default=look.guesses,
                   help="--method lookahead: G, the n-grams it verifies a round, of those starting with the last token "
                        "(the reference's GUESS_SET_SIZE)")
    p.add_argument("--lookahead-from-context", action="store_true",
                   help="--method lookahead: its pool also holds the request's own n-grams, the prompt's and the reply's "
                        "(the reference's POOL_FROM_PROMPT, and the reply's)")
    p.add_argument("--staged-tree", action="store_true",
                   help="--method staged: each round the tree of both stages -- the draft model's chain and n-gram "
                        "lookup's -- verified in one forward (else the draft model's chain, with its q)")
    p.add_argument("--skip-layers", default=None, metavar="LIST",
                   help="--method layer-skip: the target's decoder layers the drafts leave out, e.g. 3,5,7-12 "
                        "(`headstart layer-skip --config RECIPE` searches for a set)")
    p.add_argument("--compile", action="store_true",
                   help="the target's decode forward and the drafter's step through torch.compile over static KV "
                        "caches (CUDA graphs on a GPU); --max-len then defaults to 1024, as every forward attends over "
                        "all of it. With --batch-size > 1 the batch's target forward and EAGLE-3's and MTP's batched "
                        "draft layers compile (finished rows stay in the batch, so nothing recompiles)")
    p.add_argument("--confidence-threshold", type=float, default=0.0,
                   help="chains of a model drafter (a head, --method draft-model, hf-assisted) stop after the first draft "
                        "the drafter gives a probability below this (transformers' assistant_confidence_threshold; 0: "
                        "always k drafts); a head with a confidence head (DSpark) stops after the first draft whose "
                        "predicted chance that every draft so far is accepted falls below it (vLLM's rule; SGLang's "
                        "and DeepSpec's threshold compares each draft's own). With --compile a chain runs step by step "
                        "instead of as one graph")
    add_online_args(p)
    p.add_argument("--verification", choices=RULES, default="token",
                   help="with --temperature > 0, how drafts are verified: token by token (Leviathan et al.), or a chain "
                        "jointly as a block (Sun et al., 2025; vLLM's rejection_sample_method \"block\"), both keeping "
                        "the target's distribution exactly, block never keeping fewer drafts in expectation; or typical "
                        "acceptance (Medusa-2: a draft kept where typical under the target, the next token greedy), "
                        "NOT lossless: the benchmark reports its quality cost")
    p.add_argument("--typical-threshold", type=float, default=Verification.threshold,
                   help="--verification typical: a draft is kept where p(x) > min(THRESHOLD, ALPHA * exp(-entropy(p)))")
    p.add_argument("--typical-alpha", type=float, default=Verification.alpha)
    p.add_argument("--tune-blocks", action="store_true",
                   help="eager, batch 1: time the target's forward over 1..k+1 tokens first and run each shorter block "
                        "padded to the cheapest size that holds it (a CPU BLAS can make 2-3 rows cost more than 5)")


def add_decoding_args(p: argparse.ArgumentParser) -> None:
    """How the target decodes: greedy or sampling, the token budget, the dtype."""
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--dtype", default=None, help="target dtype (default bfloat16 on GPU, float32 on CPU)")


def verification_of(args: argparse.Namespace) -> Verification:
    """``--verification`` and typical acceptance's parameters."""
    return Verification(args.verification, args.typical_threshold, args.typical_alpha)


def sampling_of(args: argparse.Namespace) -> Sampling | None:
    """``add_decoding_args``' sampling settings, or None for greedy decoding (temperature 0)."""
    return Sampling(args.temperature, args.top_k, args.top_p) if args.temperature > 0 else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    add_method_args(p)
    add_decoding_args(p)
    p.add_argument("--questions", required=True)
    p.add_argument("--limit", type=int, default=None, help="only the first N questions (of those --per-category keeps)")
    p.add_argument("--per-category", type=int, default=None, help="only the first N questions of each category (applied before --limit)")
    p.add_argument("--verify-greedy", action="store_true", help="exit non-zero if speculative output differs from plain")
    p.add_argument("--no-hf-reference", action="store_true", help="skip timing HF generate")
    p.add_argument("--predict", action="store_true", help="predict the chain speed-up for k = 1..8 from measured step times")
    p.add_argument("--batch-size", type=int, default=1,
                   help="decode this many questions' turns together (chains; tokens/s and speed-up over the batch)")
    p.add_argument("--versus", default=None, metavar="'FLAGS'",
                   help="a second method decoded on every turn in the same process, e.g. --versus '--method "
                        "hf-prompt-lookup': its own flags (method, draft, shape, n-gram lookup, --compile; the target, "
                        "questions and decoding settings are the first's). The two take turns at decoding first and "
                        "compare turn by turn (results.json 'paired'); its own results go to OUT/versus (batch size 1)")
    p.add_argument("--out", required=True)
    p.add_argument("--overwrite", action="store_true",
                   help="move what --out holds aside (to <out>.old-<time>) and write there")
    p.add_argument("--benchmarks", default=None, help="append the table to this markdown file")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, by name, flags that do not go together (a method's by what its catalog entry says it can do)."""
    m = drafting_methods()[args.method]
    refused = m.unsupported(args.method, args)  # what the method's drafter does not declare, before any weight loads
    if refused:
        p.error(refused)
    refused = m.check(args) if m.check is not None else None  # its own flags' values
    if refused:
        p.error(refused)
    refused = online_refusal(p, args, m)
    if refused:
        p.error(refused)
    if args.ngram_store and not m.ngram_store and args.hybrid_ngram is None:
        p.error("--ngram-store is n-gram lookup's datastore: use it with --method ngram or --hybrid-ngram")
    if args.ngram_learn and not m.ngram_store and args.hybrid_ngram is None:
        p.error("--ngram-learn grows n-gram lookup's datastore: use it with --method ngram or --hybrid-ngram")
    if args.datastore and not m.datastore:
        p.error(f"--datastore is REST's datastore: use it with --method rest or suffix, not --method {args.method}")
    for other in drafting_methods().values():  # a method's own flags, set for another
        for dest in other.flags:
            if dest not in m.flags and getattr(args, dest) != p.get_default(dest):
                p.error(f"--{dest.replace('_', '-')} is another method's flag: --method {args.method} takes none of "
                        f"{', '.join('--' + d.replace('_', '-') for d in other.flags)}")
    if m.datastore == "required" and not args.datastore:
        p.error(f"--method {args.method} drafts from a datastore: add --datastore DIR (`headstart datastore` builds one)")
    if args.ngram_learn and args.batch_size > 1:
        p.error("--ngram-learn learns from one sequence at a time: use --batch-size 1")
    if args.hybrid_ngram is not None and (args.tree_paths or args.batch_size > 1 or args.predict or args.hybrid_ngram < 0):
        p.error("--hybrid-ngram SCORE (>= 0) puts n-gram lookup in front of a head or --method draft-model, in chains or "
                "dynamic trees (--tree) at batch size 1, without --predict (which drafter runs depends on k)")
    if args.hybrid_model_tree and (args.hybrid_ngram is None or not args.tree
                                   or args.hybrid_model_tree[0] > args.tree_depth
                                   or args.hybrid_model_tree[2] > args.tree_total_tokens):
        p.error("--hybrid-model-tree DEPTH TOPK TOKENS is the model's tree behind n-gram lookup: with --hybrid-ngram and "
                "--tree, at most --tree-depth deep and --tree-total-tokens tokens (the verify block)")
    if m.own_loop and (args.temperature > 0 or args.predict):
        p.error(f"{args.method} is benchmarked greedy and without --predict (transformers' loop is one call)")
    if args.verification != "token" and (args.temperature == 0 or m.own_loop):
        p.error(f"--verification {args.verification} verifies sampled drafts: it needs --temperature > 0 (greedy "
                "verification has one rule) and a headstart method")
    if args.verification == "block" and (args.tree or args.tree_paths):
        p.error("--verification block verifies a chain; a tree is verified node by node (drop --tree/--tree-paths)")
    if args.verification != "typical" and (args.typical_threshold != Verification.threshold
                                           or args.typical_alpha != Verification.alpha):
        p.error("--typical-threshold/--typical-alpha set typical acceptance: use them with --verification typical")
    if args.verify_greedy and args.temperature > 0:
        p.error("--verify-greedy checks greedy output; it needs --temperature 0")
    if args.batch_size < 1:
        p.error("--batch-size must be >= 1")
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1 (the prompt's forward yields the first token)")
    if args.ngram_max < 1:
        p.error("--ngram-max is the longest suffix n-gram lookup looks up: >= 1")
    if args.compile and m.own_loop:
        p.error("--compile runs headstart's loops (transformers' loops are eager)")
    if args.batch_size > 1 and (args.tree or args.tree_paths or m.own_loop or args.predict):
        p.error("--batch-size > 1 decodes headstart's chains: drop --tree/--tree-paths/--predict, or use a headstart "
                "method (transformers' loops are benchmarked at batch size 1)")
    if args.confidence_threshold and (args.tree or args.tree_paths or args.batch_size > 1):
        p.error("--confidence-threshold stops the chains of a model drafter at batch size 1: not trees "
                "(a dynamic tree already keeps its likeliest drafts) or --batch-size > 1")
    if args.tune_blocks and (args.compile or args.batch_size > 1 or args.tree or args.tree_paths or m.own_loop):
        p.error("--tune-blocks pads an eager runner's chain blocks: not with --compile (it pads to its graphs), "
                "--batch-size > 1, trees or transformers' loops")
    if args.confidence_threshold and args.predict:
        p.error("--predict times full chains of k = 1..8 drafts; run it without --confidence-threshold")
    if m.draft and not args.draft:
        p.error(f"--method {args.method} needs --draft ({m.draft})")
    check_numbers(args)


def check_numbers(args: argparse.Namespace) -> None:
    """Refuse, by flag, a number no run can use (``--num-speculative-tokens 0``, ``--temperature -1``) before anything
    loads; bench's and generate's flags alike."""
    given = vars(args)
    check_at_least(num_speculative_tokens=(args.num_speculative_tokens, 1), temperature=(args.temperature, 0),
                   top_k=(args.top_k, 0), tree_depth=(args.tree_depth, 1), tree_topk=(args.tree_topk, 1),
                   tree_total_tokens=(args.tree_total_tokens, 1), max_len=(args.max_len, 1),
                   confidence_threshold=(args.confidence_threshold, 0), limit=(given.get("limit"), 1),
                   per_category=(given.get("per_category"), 1))
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p {args.top_p}: must be in (0, 1] (1 keeps every token)")
    if not (0 < args.typical_threshold <= 1 and args.typical_alpha > 0):
        raise UserError(f"--typical-threshold {args.typical_threshold} / --typical-alpha {args.typical_alpha}: the "
                        "threshold must be in (0, 1] and alpha > 0")


def check_inputs(args: argparse.Namespace) -> None:
    """Before the target loads: the target's and ``--draft``'s files readable and whole, a head of the kind
    ``--method`` decodes and trained for this target, the questions well formed, ``--out`` free. Warns when the chain
    is longer than the head was trained to draft."""
    check_readable(args.target, "--target", weights=False)
    method = drafting_methods()[args.method]
    if args.draft and method.draft:
        found = check_draft(args.draft, args.method, method.head)
        if not args.allow_other_target:  # with it, loading the head warns
            check_target(args.draft, args.target)
        depth = trained_depth(args.draft) if found else None
        k = args.tree_depth if args.tree else args.num_speculative_tokens
        if depth and k > depth and not args.tree_paths:
            print(f"warning: {'--tree-depth' if args.tree else '--num-speculative-tokens'} {k} is more than the {depth} "
                  f"drafts per round the head in {args.draft} was made for (its config.json): drafts past them are "
                  "rarely accepted, and each costs a draft step", file=sys.stderr)
    if args.datastore is not None:
        Datastore.load(args.datastore)  # its files whole, before the target loads (its tokenizer: when the method builds)
    if args.questions is not None:
        read_questions(args.questions)
    if vars(args).get("out") is not None:
        check_out_dir(args.out, "--out", args.overwrite, inputs_of(args))


def inputs_of(args: argparse.Namespace) -> list[str]:
    """What a run reads, which its ``--out`` may not be, hold or lie inside."""
    return [path for path in (args.target, args.draft, args.questions, args.tree_paths, args.datastore) if path]


def versus_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """The second method's flags (``--versus``), parsed like the first's, with what it shares taken from the first."""
    tokens = shlex.split(args.versus)
    second = p.parse_args(["--target", args.target, "--questions", args.questions, "--out", str(Path(args.out) / "versus"),
                           *tokens])
    given = [d for d in (*SHARED, "versus", "predict") if getattr(second, d) != (
        getattr(args, d) if d in ("target", "questions") else p.get_default(d))]
    if given:
        p.error(f"--versus takes the second method's own flags; {', '.join('--' + d.replace('_', '-') for d in given)} "
                "is the first's (the target, questions and decoding settings are shared; --predict models the first)")
    if args.batch_size > 1:
        p.error("--versus compares two methods at batch size 1")
    for d in SHARED:
        setattr(second, d, getattr(args, d))
    second.benchmarks = None
    check_args(p, second)
    return second


@dataclass
class Method:
    """What one method's flags build: its runner over the shared target, its drafter factories (or transformers'
    loop), its tree and n-gram store, the hybrids it made (for their round counts)."""

    args: argparse.Namespace
    runner: TargetRunner
    make: Callable[[], object] | None
    make_batch: Callable[[int], object] | None
    own_loop: HFSpeculation | None
    tree: DynamicTree | StaticTree | None
    store: NgramStore | None
    hybrids: list[HybridDrafter]
    compiled_drafter: bool
    pads: dict[int, int] | None
    forget: Callable[[], None] | None
    """Undo what the untimed warm-up taught a drafter that learns as it serves."""
    learned: Callable[[], str] | None
    """What the drafter learned, for the run's mode."""
    learner: OnlineLearner | None = None
    """``--online``'s learner: what ``--online-save`` exports."""

    def rival(self) -> Rival:
        return Rival(self.runner, self.make, self.args.num_speculative_tokens, self.tree, self.own_loop, self.forget,
                     verification_of(self.args))


def build_method(p: argparse.ArgumentParser, args: argparse.Namespace, setup: DecodeSetup) -> Method:
    target, tokenizer, k = setup.target, setup.tokenizer, args.num_speculative_tokens
    pads = None
    max_len = args.max_len or (min(1024, target.context_length) if args.compile else target.context_length)
    method = drafting_methods()[args.method]
    batched = args.batch_size > 1  # the batch's own runner (decode/batch_generate.py), compiled with --compile
    # an online head reads the aux states to learn even where its drafter does not read them to draft
    with_aux = method.capabilities.reads_aux or (args.online and head_spec(method.head).cls.needs.aux_hidden_states)
    runner = (RaggedRunner if batched else TargetRunner)(target, max_len=max_len, with_aux=with_aux, compile=args.compile)
    if args.tune_blocks:
        try:
            pads = runner.tune_blocks(k + 1)
        except ValueError as e:
            p.error(f"--tune-blocks: {e} (raise --max-len)")
        print("blocks of n tokens run at: " + ", ".join(f"{n} -> {m}" for n, m in pads.items()), file=sys.stderr,
              flush=True)
    tree = draft_tree(args.tree_paths, args.tree, args.tree_depth, args.tree_topk, args.tree_total_tokens)
    model_tree = DynamicTree(*args.hybrid_model_tree) if args.hybrid_model_tree else None
    block = compiled_block(k, tree, model_tree)
    store = ngram_store_from_conversations(args.ngram_store, tokenizer) if args.ngram_store else None
    if args.ngram_learn and store is None:
        store = NgramStore()  # learning only: SuffixDecoding's global tree from nothing
    try:
        built = method.build(MethodContext(args, setup, max_len, block, store))
    except MethodError as err:
        p.error(str(err))
    make, tree = built.make, built.tree or tree  # a drafter of its own trees: its method's shape, every round
    if not batched:  # the batched loop compiles each batch size it runs (decode/measure.py)
        precompile_runner(runner, k, tree)
    hybrids: list[HybridDrafter] = []
    if args.hybrid_ngram is not None:
        model_drafter = make

        def make() -> HybridDrafter:
            # a compiled drafter reads late rounds in commits of the sizes it precompiled
            hybrids.append(HybridDrafter(model_drafter(), NgramDrafter(args.ngram_max, store=store, learn=args.ngram_learn),
                                         args.hybrid_ngram, max_flush=block if args.compile else None,
                                         model_tree=model_tree))
            return hybrids[-1]
    forget, learned, learner = store.forget if args.ngram_learn else built.forget, built.describe, None
    if args.online:  # every request's drafter records what it serves for the learner, which trains the head they read
        learner, model_drafter = online_learner(args, built.head, target), make
        make, forget, learned = lambda: learner.drafter(model_drafter()), learner.forget, learner.describe  # noqa: E731
    return Method(args, runner, make, built.make_batch, built.own_loop, tree, store, hybrids, built.compiled, pads,
                  forget, learned, learner)


def describe(method: Method, report: dict, setup: DecodeSetup) -> tuple[str, str]:
    """The run's shape and mode, as its table and plot name them; a hybrid's round counts go into ``report``."""
    args = method.args
    rounds = None
    if method.hybrids:  # every round of the run's hybrids: the timed turns' and the untimed warm-up's few
        rounds = report["hybrid_rounds"] = {who: sum(h.rounds[who] for h in method.hybrids) for who in ("ngram", "model")}
    mode = run_mode(args, setup.dtype, default_dtype(setup.device), method.compiled_drafter,
                    method.store.learned_tokens if args.ngram_learn else None, rounds,
                    method.pads if args.tune_blocks else None)
    if method.learned is not None:
        mode += f", {method.learned()}"
    return run_shape(args.num_speculative_tokens, method.tree), mode


def write_run(method: Method, report: dict, shape: str, mode: str, table: str) -> None:
    args = method.args
    write_results(args.out, {**vars(args), "compiled_drafter": method.compiled_drafter}, report, shape, mode, table,
                  args.method)


@refusals
def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    second = versus_args(p, args) if args.versus else None
    check_inputs(args)
    if second is not None:  # its --out is OUT/versus, inside the first's
        check_inputs(argparse.Namespace(**{**vars(second), "out": None}))
    setup = decode_setup(args.target, args.dtype, args.questions, args.limit, args.per_category)
    device, dtype, tokenizer, questions, eos = setup.device, setup.dtype, setup.tokenizer, setup.questions, setup.eos
    method = build_method(p, args, setup)
    rival = build_method(p, second, setup) if second is not None else None
    runner, make, tree = method.runner, method.make, method.tree
    sampling = sampling_of(args)
    claim_dir(args.out, "--out", args.overwrite, inputs_of(args))  # with --overwrite, the last run's files move aside
    report = run_benchmark(runner, make, tokenizer, questions, args.num_speculative_tokens, args.max_new_tokens, eos,
                           verify_greedy=args.verify_greedy, hf_reference=not args.no_hf_reference, tree=tree,
                           sampling=sampling, seed=args.seed, own_loop=method.own_loop, batch_size=args.batch_size,
                           make_batch_drafter=method.make_batch,
                           after_warm_up=method.rival().after_warm_up,
                           versus=rival.rival() if rival is not None else None, verification=verification_of(args),
                           progress=lambda line: print(line, flush=True))
    shape, mode = describe(method, report, setup)
    table = run_table(report)
    versus = report.pop("versus", None)  # the second method's report: a run directory of its own, OUT/versus
    if rival is not None:
        versus_shape, versus_mode = describe(rival, versus, setup)
        versus_table = run_table(versus)
        write_run(rival, {**versus, "paired_with": args.out}, versus_shape, versus_mode, versus_table)
        report["versus_out"] = second.out
        line = paired_line(report["paired"], args.method, second.method)
        table += f"\n\n{line} The second method ({second.method}, {versus_shape}, {versus_mode}): `{second.out}`."
        print(f"--versus {second.method}:\n{versus_table}")
    if args.predict:
        if tree is not None:
            p.error("--predict models chains; run it without --tree")
        prompt = prompt_ids(tokenizer, [{"role": "user", "content": questions[0]["turns"][0]}]).to(device)
        overall = report["results"]["overall"]
        report["prediction"] = predict_chains(runner, make(), prompt, overall, args.num_speculative_tokens)
        table += "\n\n" + prediction_table(report["prediction"], overall, args.num_speculative_tokens)
    if args.tune_blocks:  # what the run measured and padded: the mode column only says that it did
        report["blocks"] = {"padded_to": method.pads, "seconds": runner.block_costs}
    write_run(method, report, shape, mode, table)
    for m in (method, rival):
        if m is not None:
            save_learned(m.args, m.learner, drafting_methods()[m.args.method].head)
    print(table)
    if args.benchmarks:
        append_section(args.benchmarks, f"Speculative decoding: {args.method}, {shape}, {mode}",
                       f"{len(questions)} questions of `{args.questions}` (all turns), max {args.max_new_tokens} new tokens, "
                       f"target `{args.target}` ({dtype}), draft `{args.draft}`. tau = tokens per target forward, bonus "
                       "included; acceptance by position i = share of rounds that accepted at least i drafts (of those that "
                       "proposed at least i; for trees, i = depth); speed-up = plain / speculative time on the same runner.\n\n"
                       + table)
    failed = False
    checked = args.verify_greedy and not sampling
    for name, r in [(args.method, report)] + ([(f"--versus {second.method}", versus)] if versus else []):
        if r["near_ties"]:  # reduced precision: block and one-token forwards round differently (decode/exactness.py)
            print(f"{name}, {dtype}: speculative output first differs from plain greedy decoding at a near-tie of the "
                  "target's logits (numerics, not a decoding error) at: " + "; ".join(r["near_ties"]), file=sys.stderr)
        if r["mismatches"]:
            print(f"{name}: speculative output differs from plain greedy decoding at: " + "; ".join(r["mismatches"]),
                  file=sys.stderr)
            failed = True
    verdict = ("" if not checked else "; greedy check FAILED (see above)" if failed else
               "; output identical to plain greedy decoding (--verify-greedy)")
    print(f"wrote {args.out}/results.json, results.md and acceptance.png{verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(entry_point(main))
