"""The head catalog and what reads it: one line a head (``HEADS``), each head's ``HeadSpec`` in its own folder.

A head is a module class (``cls``: its feature ``needs``, ``loss``, export ``layouts``, the writer
``save_pretrained`` and the reader ``load``), the dataclass of its own recipe fields, a builder, the drafter
that decodes it, a detector and checker for its exports, and what its card says (heads/spec.py). The trainer,
the feature pipeline, the decoder's method catalog, ``check_head``, ``publish_head`` and the export tools read
heads only through this table; adding a head is its folder plus one line here (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from headstart.heads.dflash.spec import DFLASH
from headstart.heads.dflash2.spec import DFLASH2
from headstart.heads.draft_model.spec import DRAFT_MODEL
from headstart.heads.dspark.spec import DSPARK
from headstart.heads.early_exit.spec import EARLY_EXIT
from headstart.heads.eagle3.spec import EAGLE3
from headstart.heads.hydra.spec import HYDRA
from headstart.heads.medusa.spec import MEDUSA
from headstart.heads.mtp.spec import MTP
from headstart.heads.peagle.spec import PEAGLE
from headstart.heads.spec import HeadSpec
from headstart.models.head import DraftConfig, DraftHead
from headstart.models.provenance import check_record, check_target


HEADS: dict[str, HeadSpec] = {"eagle3": EAGLE3, "medusa": MEDUSA, "mtp": MTP, "peagle": PEAGLE, "dflash": DFLASH,
                             "hydra": HYDRA, "draft_model": DRAFT_MODEL, "early-exit": EARLY_EXIT, "dspark": DSPARK,
                             "dflash2": DFLASH2}
"""The head catalog: one line a head; each head's spec is in its folder (heads/<name>/spec.py)."""

DEFAULT_HEAD = "eagle3"
"""The head a recipe trains when its ``draft:`` section names none."""

SHARED_FIELDS = tuple(f.name for f in dataclasses.fields(DraftConfig) if f.name != "options")
"""The ``draft:`` fields every head reads; the others belong to one head's ``options``."""


def register_head(name: str, spec: HeadSpec) -> None:
    """Add a head defined outside this package (its own folder anywhere on the path) to the catalog, as one line: every
    tool and the conformance suite then read it like a shipped head (tests/conftest.py registers the test tree's toy
    head so). Refused by name if ``name`` is taken or the head redefines a shared ``draft:`` field."""
    if name in HEADS:
        raise ValueError(f"a head named {name!r} is already registered ({HEADS[name].title})")
    clash = sorted({f.name for f in dataclasses.fields(spec.options)} & set(SHARED_FIELDS))
    if clash:
        raise ValueError(f"head {name!r}: its options redefine the shared draft fields {clash}")
    HEADS[name] = spec


def head_spec(name: str) -> HeadSpec:
    if name not in HEADS:
        raise ValueError(f"unknown draft head {name!r}; registered heads: {sorted(HEADS)}")
    return HEADS[name]


def spec_of(head: nn.Module) -> HeadSpec:
    """The entry whose class ``head`` is: the nearest in its class's MRO (a head built on another's class, as P-EAGLE on
    EAGLE-3's, is its own entry; FSDP2's wrapper class is a subclass of the head's)."""
    by_class = {spec.cls: spec for spec in HEADS.values()}
    for cls in type(head).__mro__:
        if cls in by_class:
            return by_class[cls]
    raise ValueError(f"{type(head).__name__} is not a registered head's class; registered: "
                     f"{[s.cls.__name__ for s in HEADS.values()]}")


def option_names(name: str) -> tuple[str, ...]:
    """The recipe fields only head ``name`` reads."""
    return tuple(f.name for f in dataclasses.fields(head_spec(name).options))


def split_draft_section(values: dict, where: str = "draft.") -> tuple[HeadSpec, dict, dict]:
    """A recipe's flat ``draft:`` section -> (its head's entry, the shared fields, the head's own fields). A key
    that is neither is refused by name with the head's fields (a Medusa recipe with ``ttt_steps`` would otherwise
    train without it, silently)."""
    name = values.get("head", DEFAULT_HEAD)
    spec, own = head_spec(name), option_names(name)
    unknown = sorted(k for k in values if k not in own and k not in SHARED_FIELDS)
    if unknown:
        raise ValueError(f"{', '.join(where + k for k in unknown)}: not a field of the {name} head; its fields are "
                         f"{list(own)}, and {list(SHARED_FIELDS)} for every head")
    return (spec, {"head": name, **{k: v for k, v in values.items() if k in SHARED_FIELDS}},
            {k: v for k, v in values.items() if k in own})


def draft_fields(draft: DraftConfig) -> dict[str, Any]:
    """The flat ``draft:`` section of ``draft`` (as a recipe and run_config.json write it)."""
    options = draft.options or head_spec(draft.head).options()
    return {**{k: getattr(draft, k) for k in SHARED_FIELDS}, **dataclasses.asdict(options)}


def build_head(config: DraftConfig, target, token_counts: torch.Tensor) -> DraftHead:
    head = head_spec(config.head).build(config, target, token_counts)
    if config.init_from is not None:
        start_from(head, config.head, config.init_from, target)
    return head


def start_from(head: DraftHead, name: str, directory: str, target) -> None:
    """Copy the weights of the published head in ``directory`` (an export headstart reads) into the freshly built
    ``head``: fine-tuning it on new data. Its vocab map comes along (a draft lm_head's rows mean nothing under
    another); a head of another type or target is refused by ``load_head``, one of another shape by name here."""
    source = load_head(name, directory, target).state_dict()
    own = head.state_dict()
    wrong = [f"{k}: {tuple(source[k].shape)} there, {tuple(v.shape)} in this recipe"
             for k, v in own.items() if k in source and source[k].shape != v.shape]
    missing, extra = sorted(set(own) - set(source)), sorted(set(source) - set(own))
    if wrong or missing or extra:
        raise ValueError(f"draft.init_from={directory} does not fit this recipe's {name} head (set the draft options it "
                         f"was trained with):\n  " + "\n  ".join(wrong + [f"{k}: not in it" for k in missing]
                                                                      + [f"{k}: not in this recipe's head" for k in extra]))
    head.load_state_dict(source)


def drafter_for(head: nn.Module, max_len: int, compile: bool = False, backend: str = "inductor"):
    """The decoder's drafter for a finished ``head``, its caches holding ``max_len`` positions: a ``Drafter`` for one
    sequence and a ``BatchDrafter`` for a batch of any size; ``compile``: its step compiled with dynamo's ``backend``
    (build it once and reuse it for every prompt or batch)."""
    return spec_of(head).drafter(head, max_len, compile=compile, backend=backend)


def load_head(name: str, directory: str, target, allow_other_target: bool = False) -> DraftHead:
    """A finished head of type ``name`` from its exported directory, checked against ``target`` (a
    Target or TargetMatrices): refused by name if it records another head type or another target."""
    check_record(directory, name)
    check_target(directory, getattr(target, "path", None), allow_other_target)
    return head_spec(name).cls.load(directory, target)
