"""The drafting methods that are not heads, as one catalog: n-gram lookup, a draft model, and transformers' own
assisted generation and prompt lookup (run for comparison). Heads join them from the head catalog
(heads/methods.py ``drafting_methods``); ``headstart bench``, ``generate`` and ``check_head --questions`` build any
method through that one table, and refuse flags a method cannot take by what its entry says it can do, never by
its name. Adding a drafting method is one entry here (or one head folder).
"""

from __future__ import annotations

import argparse
from typing import Any
from collections.abc import Callable
from dataclasses import dataclass, fields

from headstart.decode.questions import DecodeSetup
from headstart.decode.confidence import with_threshold
from headstart.decode.draft_model import DraftModelDrafter, draft_model_runner
from headstart.decode.drafter import Capabilities
from headstart.decode.hf_peers import HFSpeculation
from headstart.decode.layer_skip import LayerSkipDrafter, parse_skip
from headstart.decode.lookahead import LookaheadDrafter, LookaheadParams
from headstart.decode.ngram import NgramDrafter
from headstart.decode.ngram_store import NgramStore
from headstart.decode.rest import Datastore, RestDrafter, vocab_fingerprint
from headstart.decode.staged import StageCounts, StagedDrafter, staged_tree
from headstart.decode.suffix import SuffixCache, SuffixDrafter, SuffixParams
from headstart.decode.tree import OwnTree
from headstart.models.provenance import check_target
from headstart.models.target import TargetConfig, load_causal_lm, load_tokenizer


class MethodError(ValueError):
    """A method's flags do not fit it (the command line reports it as a usage error)."""


@dataclass
class MethodContext:
    """What building a method reads: its flags, the shared target, the drafters' cache length, the largest block a
    compiled drafter runs after a prompt, and the n-gram datastore (or None)."""

    args: argparse.Namespace
    setup: DecodeSetup
    max_len: int
    compiled_block: int
    store: NgramStore | None

    @property
    def batched(self) -> bool:
        return self.args.batch_size > 1

    @property
    def vocab_size(self) -> int:
        return self.setup.target.lm_head.weight.shape[0]


@dataclass
class Drafting:
    """A built method: its drafter factories (one sequence; a batch of any size, or None: one drafter per row), or
    transformers' own loop; and whether ``--compile`` compiled its drafter."""

    make: Callable[[], object] | None
    make_batch: Callable[[int], object] | None = None
    own_loop: HFSpeculation | None = None
    compiled: bool = False
    forget: Callable[[], None] | None = None
    """Undo what the untimed warm-up taught a drafter that learns from what it serves (None: it learns nothing)."""
    describe: Callable[[], str] | None = None
    """What only the run knows about the drafter (what it learned), for the run's mode."""
    head: Any = None
    """The head module its drafters read (a catalog head's method): what ``--online`` trains as it serves."""
    tree: OwnTree | None = None
    """The tree every round drafts where the method's flags ask for its drafter's own (``Capabilities.trees`` "own":
    Lookahead always, staged drafting with ``--staged-tree``); None: chains, or ``--tree``'s."""


@dataclass(frozen=True)
class DraftingMethod:
    """One way of drafting and what it can do; the flags a method cannot take are refused by these fields
    (``unsupported``), before any weight loads."""

    help: str
    """One line for ``--method``'s help."""
    build: Callable[[MethodContext], Drafting]
    capabilities: Capabilities
    """What its drafter declares it can do (decode/drafter.py)."""
    draft: str | None = None
    """What ``--draft`` names for it ("the head's exported directory"); None: it takes no ``--draft``."""
    own_loop: bool = False
    """transformers' loop, one call a turn: chains only, greedy, eager, batch 1, no ``--predict``."""
    ngram_store: bool = False
    """It is n-gram lookup: ``--ngram-store`` and ``--ngram-learn`` are its own flags."""
    datastore: str | None = None
    """"required": it drafts from REST's datastore, ``--datastore DIR`` (``headstart datastore`` builds one);
    "optional": it reads one where given; None: it takes none."""
    flags: tuple[str, ...] = ()
    """Flags (argparse dests) that are this method's own: refused, by name, with any other method."""
    check: Callable[[argparse.Namespace], str | None] | None = None
    """Why its own flags' values cannot run (naming the flag; ``headstart bench`` checks it before any weight loads);
    None: they can."""
    head: str | None = None
    """The catalog head whose exports ``--draft`` holds (heads/methods.py); None: not a head's method."""

    def unsupported(self, name: str, args: argparse.Namespace) -> str | None:
        """Why ``--method name`` cannot run with these flags, naming the flag and what the method declares; None: it
        can. Only what the method's capabilities decide (flags that clash with each other are the command's)."""
        can = self.capabilities
        kinds = " and ".join("its own" if kind == "own" else kind for kind in can.trees)
        trees = f"its drafter drafts {kinds} trees" if can.trees else "its drafter drafts chains only"
        if not can.chains and vars(args).get("predict"):
            return f"--predict: --method {name} drafts a tree of its own every round; --predict models chains"
        if not can.chains and args.verification == "block":
            return (f"--verification block: --method {name} drafts a tree of its own every round, verified node by node "
                    "(block verification verifies a chain)")
        if args.tree and not args.tree_paths and "dynamic" not in can.trees:
            return f"--tree: --method {name} cannot draft a dynamic tree ({trees})"
        if args.tree_paths and "static" not in can.trees:
            return f"--tree-paths: --method {name} cannot draft a static tree of rank paths ({trees})"
        if args.batch_size > 1 and not can.batches:
            why = " (it drafts on the target's own cache)" if can.self_verify else ""
            return f"--batch-size {args.batch_size}: --method {name} decodes one sequence at a time{why}; use --batch-size 1"
        if args.confidence_threshold and not can.confidence:
            return (f"--confidence-threshold: --method {name} has no draft probabilities to stop a chain on (a model "
                    "drafter's chains stop under it)")
        if args.compile and can.self_verify:
            return (f"--compile: --method {name} drafts on the target's own eager runner (a compiled runner's graphs run "
                    "every layer)")
        if args.hybrid_ngram is not None and (can.self_verify or self.own_loop or self.draft is None):
            what = ("verifies its own drafts on the target's runner" if can.self_verify else
                    "is n-gram lookup already" if self.ngram_store else
                    "drafts by lookup already" if self.draft is None else "runs transformers' own loop")
            return f"--hybrid-ngram: n-gram lookup cannot take the rounds of --method {name}, which {what}"
        return None


def _ngram(ctx: MethodContext) -> Drafting:
    args = ctx.args
    return Drafting(lambda: NgramDrafter(args.ngram_max, store=ctx.store, learn=args.ngram_learn))


def _rest(ctx: MethodContext) -> Drafting:
    store = load_datastore(ctx.args.datastore, ctx.setup.tokenizer)
    return Drafting(lambda: RestDrafter(store))


SUFFIX_FLAGS = tuple(f"suffix_{f.name}" for f in fields(SuffixParams))
"""--suffix-max-depth, ...: one flag a setting of vLLM's."""


def suffix_params(args: argparse.Namespace) -> SuffixParams:
    return SuffixParams(**{f.name: getattr(args, f"suffix_{f.name}") for f in fields(SuffixParams)})


def _check_suffix(args: argparse.Namespace) -> str | None:
    try:
        suffix_params(args)
    except ValueError as err:
        return str(err)
    return None


def _suffix(ctx: MethodContext) -> Drafting:
    args = ctx.args
    params = suffix_params(args)
    store = load_datastore(args.datastore, ctx.setup.tokenizer) if args.datastore else None
    cache = SuffixCache(params, store)  # the global tree: every request of the run shares it
    return Drafting(lambda: SuffixDrafter(cache), forget=cache.forget, describe=cache.describe)


def _layer_skip(ctx: MethodContext) -> Drafting:
    try:
        skip = parse_skip(ctx.args.skip_layers, ctx.setup.target.num_layers)
    except ValueError as err:
        raise MethodError(str(err)) from None
    return Drafting(lambda: LayerSkipDrafter(skip))


def _check_layer_skip(args: argparse.Namespace) -> str | None:
    if not args.skip_layers:
        return ("--method layer-skip needs --skip-layers (the target's layers its drafts leave out; `headstart "
                "layer-skip --config RECIPE` searches for them)")
    return None


LOOKAHEAD_FLAGS = tuple(f"lookahead_{f.name}" for f in fields(LookaheadParams))
"""--lookahead-window, --lookahead-ngram, --lookahead-guesses, --lookahead-from-context."""


def lookahead_params(args: argparse.Namespace) -> LookaheadParams:
    return LookaheadParams(**{f.name: getattr(args, f"lookahead_{f.name}") for f in fields(LookaheadParams)})


def _check_lookahead(args: argparse.Namespace) -> str | None:
    try:
        params = lookahead_params(args)
    except ValueError as err:
        return str(err)
    if args.max_len is not None and params.nodes + 2 > args.max_len:
        return (f"--lookahead-window {params.window} --lookahead-ngram {params.ngram} --lookahead-guesses "
                f"{params.guesses}: a round's tree of up to {params.nodes} nodes does not fit --max-len {args.max_len} "
                "with its context")
    return None


def _lookahead(ctx: MethodContext) -> Drafting:
    params = lookahead_params(ctx.args)
    if params.nodes + 2 > ctx.max_len:
        raise MethodError(f"--lookahead-window {params.window}: a round's tree of up to {params.nodes} nodes does not "
                          f"fit the KV cache of {ctx.max_len} tokens with its context")
    return Drafting(lambda: LookaheadDrafter(params, seed=ctx.args.seed), tree=params.tree())


def load_datastore(directory: str, tokenizer) -> Datastore:
    """``--datastore``, refused by name where it was built under another tokenizer (its token ids would mean other
    words)."""
    store = Datastore.load(directory)
    built = store.meta.get("vocab_fingerprint")
    if built != vocab_fingerprint(tokenizer):
        raise MethodError(f"--datastore {directory} was built with another tokenizer (vocabulary {built}) than the "
                          f"target's ({vocab_fingerprint(tokenizer)}); rebuild it with `headstart datastore` for this target")
    return store


def _draft_model(ctx: MethodContext) -> Drafting:
    args = ctx.args
    runner = draft_model_runner(load_draft_model(ctx), ctx.max_len, compile=args.compile and not ctx.batched)  # compiled once
    runner.precompile(range(1, ctx.compiled_block + 1), masked=range(1, ctx.compiled_block + 1) if args.tree else ())
    make = with_threshold(lambda: DraftModelDrafter(runner, ctx.max_len, ctx.vocab_size), args.confidence_threshold)
    # A batch: the same drafter, on a ragged runner of its own over the same model (eager: the graphs are one row's).
    return Drafting(make, lambda _: make(), compiled=args.compile and not ctx.batched)


def _staged(ctx: MethodContext) -> Drafting:
    args = ctx.args
    runner = draft_model_runner(load_draft_model(ctx), ctx.max_len)  # eager: its blocks are of any length up to k
    counts = StageCounts()  # every request's: the run's forwards per draft
    return Drafting(lambda: StagedDrafter(runner, ctx.max_len, ctx.vocab_size, args.ngram_max, counts),
                    forget=counts.reset, describe=counts.describe,
                    tree=staged_tree(args.num_speculative_tokens) if args.staged_tree else None)


def _check_staged(args: argparse.Namespace) -> str | None:
    if args.hybrid_ngram is not None:
        return "--hybrid-ngram: --method staged has n-gram lookup drafting for its draft model already"
    if args.staged_tree and (vars(args).get("predict") or args.verification == "block"):
        return ("--staged-tree verifies a tree of both stages' chains: not with --predict or --verification block "
                "(they are a chain's)")
    return None


def load_draft_model(ctx: MethodContext):
    """``--draft`` as an HF causal LM sharing the target's vocabulary, refused by name otherwise (and, when it records
    the target it was distilled from, refused for another one)."""
    args, setup = ctx.args, ctx.setup
    check_target(args.draft, args.target, getattr(args, "allow_other_target", False))
    if load_tokenizer(args.draft).get_vocab() != setup.tokenizer.get_vocab():
        raise MethodError(f"the draft model {args.draft} has another tokenizer than the target {args.target}; "
                          "a draft model must share its target's vocabulary")
    return load_causal_lm(TargetConfig(path=args.draft, dtype=setup.dtype, device=setup.device))


def _hf(assisted: bool) -> Callable[[MethodContext], Drafting]:
    def build(ctx: MethodContext) -> Drafting:
        args, setup = ctx.args, ctx.setup
        peer = {"assistant": load_draft_model(ctx)} if assisted else {"prompt_lookup": True}
        return Drafting(None, own_loop=HFSpeculation(setup.target.model, args.num_speculative_tokens,
                                                     pad_token_id=setup.tokenizer.pad_token_id or 0,
                                                     confidence_threshold=args.confidence_threshold, **peer))

    return build


METHODS: dict[str, DraftingMethod] = {
    "ngram": DraftingMethod("n-gram lookup in the request's own tokens (and --ngram-store's)", _ngram,
                            NgramDrafter.capabilities, ngram_store=True),
    "rest": DraftingMethod("REST: what followed the context's longest suffix in --datastore (a suffix array)", _rest,
                           RestDrafter.capabilities, datastore="required"),
    "suffix": DraftingMethod("suffix decoding: the request's own suffix tree and a global one of the replies served "
                             "(and --datastore's, where given), with adaptive draft lengths", _suffix,
                             SuffixDrafter.capabilities, datastore="optional", flags=SUFFIX_FLAGS,
                             check=_check_suffix),
    "layer-skip": DraftingMethod("Draft & Verify: the target itself with --skip-layers left out drafts, all layers verify",
                                 _layer_skip, LayerSkipDrafter.capabilities, flags=("skip_layers",),
                                 check=_check_layer_skip),
    "lookahead": DraftingMethod("Lookahead decoding: the target's own Jacobi iterations over a window of guesses and the "
                                "n-grams they make, both in the verifying forward", _lookahead,
                                LookaheadDrafter.capabilities, flags=LOOKAHEAD_FLAGS, check=_check_lookahead),
    "draft-model": DraftingMethod("a small causal LM of the target's vocabulary", _draft_model,
                                  DraftModelDrafter.capabilities, draft="an HF causal LM directory"),
    "staged": DraftingMethod("staged speculative decoding: --draft's draft model, its chain drafted by n-gram lookup "
                             "(--ngram-max) and checked in one forward of it", _staged, StagedDrafter.capabilities,
                             draft="an HF causal LM directory", flags=("staged_tree",), check=_check_staged),
    "hf-assisted": DraftingMethod("transformers' assisted generation with --draft's model (greedy)", _hf(True),
                                  Capabilities(confidence=True), draft="an HF causal LM directory", own_loop=True),
    "hf-prompt-lookup": DraftingMethod("transformers' prompt lookup (greedy)", _hf(False), Capabilities(),
                                       own_loop=True),
}
"""The drafting methods that are not heads, one entry each."""
