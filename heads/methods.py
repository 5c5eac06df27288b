"""Every drafting method headstart runs, in one table: a method per head of the catalog (heads/registry.py), and the
methods that are not heads (decode/methods.py). ``headstart bench``, ``generate`` and ``check_head --questions``
build a method only through ``drafting_methods``."""

from __future__ import annotations

from headstart.decode.confidence import with_threshold
from headstart.decode.methods import METHODS, Drafting, DraftingMethod, MethodContext
from headstart.heads.registry import HEADS, load_head
from headstart.heads.spec import HeadSpec


def head_method(name: str, spec: HeadSpec) -> DraftingMethod:
    """A head as a drafting method: its exported directory in ``--draft`` (read as head ``name``), its drafter
    ``spec.drafter`` (benchmarks/versus_revision.py passes the spec with another revision's drafter class)."""

    def build(ctx: MethodContext) -> Drafting:
        args, target = ctx.args, ctx.setup.target
        head = load_head(name, args.draft, target, args.allow_other_target).to(device=ctx.setup.device,
                                                                              dtype=target.lm_head_weight.dtype)
        compiled = False
        if args.compile:  # one drafter for every prompt or batch (begin starts it afresh): compiled once, up front
            shared = spec.drafter(head, ctx.max_len, compile=True)
            if not ctx.batched:  # a threshold drafts step by step through the masked step's graphs, as trees do
                shared.precompile(ctx.compiled_block, trees=bool(args.tree or args.tree_paths) or args.confidence_threshold > 0)
            make = make_batch = lambda *_: shared  # noqa: E731
            # The drafter compiles where it declares compiled graphs (one sequence's; a batch's where it declares a
            # compiled batch path: Medusa's few ops run eagerly).
            compiled = spec.capabilities.compiled_batch if ctx.batched else spec.capabilities.compiled
        else:
            make = make_batch = lambda *_: spec.drafter(head, ctx.max_len)  # noqa: E731
        make = with_threshold(make, args.confidence_threshold)
        return Drafting(make, make_batch, compiled=compiled, head=head)

    return DraftingMethod(f"a trained {spec.title} (its exported directory in --draft)", build, spec.capabilities,
                          draft="the head's exported directory", head=name)


def drafting_methods() -> dict[str, DraftingMethod]:
    """Every method by its ``--method`` name: the heads first, then the others."""
    return {**{name: head_method(name, spec) for name, spec in HEADS.items() if spec.decoded_by is None}, **METHODS}
