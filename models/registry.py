"""The registry of draft heads: one entry per head names every part of it the rest of headstart uses.

A head is a module class (``cls``: its feature ``needs``, ``loss``, export ``layouts``, the writer
``save_pretrained`` and the reader ``load``), the dataclass of its own recipe fields, a builder, the drafter
that decodes it, a detector and checker for its exports, and what its card says. The trainer, the feature
pipeline, the decoder, ``check_head``, ``publish_head`` and the export tools read heads only through this
table; adding a head is one new entry here and its own files (docs/ARCHITECTURE.md walks through one).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from headstart.decode.batch_generate import PerSequence
from headstart.decode.eagle3_batch_drafter import Eagle3BatchDrafter
from headstart.decode.eagle3_drafter import Eagle3Drafter
from headstart.decode.medusa_batch_drafter import MedusaBatchDrafter
from headstart.decode.medusa_drafter import MedusaDrafter
from headstart.decode.mtp_batch_drafter import MTPBatchDrafter
from headstart.decode.mtp_drafter import MTPDrafter
from headstart.models.eagle3 import Eagle3Draft, Eagle3Options, build_eagle3
from headstart.models.eagle3_check import check_eagle3, detect_eagle3
from headstart.models.head import DraftConfig, DraftHead
from headstart.models.medusa import MedusaHeads, MedusaOptions, build_medusa, detect_medusa
from headstart.models.mtp import MTPHead, MTPOptions, build_mtp_head
from headstart.models.mtp_checkpoint import detect_mtp
from headstart.models.provenance import check_record, check_target
from headstart.models.speculators_layout import convert_eagle3


@dataclass(frozen=True)
class HeadSpec:
    """Everything headstart asks of one kind of head."""

    title: str
    """What a card calls it ("EAGLE-3 head")."""
    cls: type
    """The module class: ``needs``, ``loss``, ``layouts``, ``save_pretrained`` (writer), ``load(directory, target)``."""
    options: type
    """Dataclass of the recipe fields only this head reads (a recipe's ``draft:`` section, besides the shared ones)."""
    build: Callable[[DraftConfig, Any, torch.Tensor], DraftHead]
    """(draft config, target, loss-masked token counts [V]) -> a fresh head for that target."""
    drafter: Callable[..., Any]
    """(finished head, cache length, compile=False) -> the decoder's ``Drafter`` for it (decode/generate.py);
    ``compile``: its draft step through ``torch.compile`` at static shapes (decode/static_blocks.py)."""
    detect: Callable[[Path, dict], str | None]
    """(export directory, its config.json) -> the layout it holds, or None if it is not this head's."""
    cards: dict[str, str]
    """Per layout it can be exported in, what a published head's card says of it (files, which server reads it)."""
    unit: str
    """What one row of the per-step metrics describes ("TTT step k")."""
    check: Callable[[Path, str, Any], list] | None = None
    """``check_head``'s rules: (directory, layout, target config) -> problems; None: the reader's refusals."""
    convert: Callable[..., Path] | None = None
    """(source, out, to layout, verifier, force) -> out: rewrite an export in another of its layouts."""
    batch_drafter: Callable[..., Any] | None = None
    """(finished head, cache length, batch size, compile=, backend=) -> a ``BatchDrafter`` running one draft forward for every row
    (decode/batch_generate.py); None: the batch runs one ``drafter`` per sequence."""


HEADS: dict[str, HeadSpec] = {
    "eagle3": HeadSpec(
        title="EAGLE-3 head", cls=Eagle3Draft, options=Eagle3Options, build=build_eagle3, drafter=Eagle3Drafter,
        batch_drafter=Eagle3BatchDrafter,
        detect=detect_eagle3, check=check_eagle3, convert=convert_eagle3, unit="TTT step k",
        cards={"flat": "Flat EAGLE-3 server layout (config.json + model.safetensors with d2t/t2d; no embed_tokens: the "
                       "target's are used).",
               "speculators": "vLLM's speculators layout (`vllm serve` detects it; the config names the target)."}),
    "medusa": HeadSpec(
        title="Medusa heads", cls=MedusaHeads, options=MedusaOptions, build=build_medusa, drafter=MedusaDrafter,
        batch_drafter=MedusaBatchDrafter, detect=detect_medusa, unit="head k+1 (predicts token t+k+2)",
        cards={"vllm": "vLLM's Medusa layout (config.json with num_heads / num_hidden_layers, blocks.{i}.layers.{j} "
                       "and lm_heads.{i} in model.safetensors)."}),
    "mtp": HeadSpec(
        title="MTP layer", cls=MTPHead, options=MTPOptions, build=build_mtp_head, drafter=MTPDrafter,
        batch_drafter=MTPBatchDrafter, detect=detect_mtp, unit="unrolled step k (predicts token t+k+2)",
        cards={"headstart": "headstart's own MTP layout for a dense target (config.json + model.safetensors: enorm, "
                            "hnorm, eh_proj, block.*, norm; the target's embedding and lm_head are shared).",
               "deepseek": "DeepSeek-V3's own checkpoint layout: a copy of the target with the trained layer as "
                           "model.layers.{L}.* (what vLLM's and SGLang's MTP loaders read).",
               "qwen3_next": "Qwen3-Next's own checkpoint layout: a copy of the target with the trained layer as mtp.*."}),
}

DEFAULT_HEAD = "eagle3"
"""The head a recipe trains when its ``draft:`` section names none."""

SHARED_FIELDS = tuple(f.name for f in dataclasses.fields(DraftConfig) if f.name != "options")
"""The ``draft:`` fields every head reads; the others belong to one head's ``options``."""


def head_spec(name: str) -> HeadSpec:
    if name not in HEADS:
        raise ValueError(f"unknown draft head {name!r}; registered heads: {sorted(HEADS)}")
    return HEADS[name]


def spec_of(head: nn.Module) -> HeadSpec:
    """The entry whose class ``head`` is."""
    for spec in HEADS.values():
        if isinstance(head, spec.cls):
            return spec
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
    """The decoder's drafter for a finished ``head``, its caches holding ``max_len`` positions; ``compile``: its step
    compiled with dynamo's ``backend`` (build it once and reuse it for every prompt)."""
    return spec_of(head).drafter(head, max_len, compile=compile, backend=backend)


def batch_drafter_for(head: nn.Module, max_len: int, batch: int, compile: bool = False, backend: str = "inductor"):
    """The decoder's ``BatchDrafter`` for ``batch`` sequences: the head's batched drafter, or one (eager) drafter per
    row. ``compile``: the batched drafter's layer compiled (build it once and reuse it: ``begin`` resets it to each
    batch, of any size)."""
    spec = spec_of(head)
    if spec.batch_drafter is not None:
        return spec.batch_drafter(head, max_len, batch, compile=compile, backend=backend)
    return PerSequence([spec.drafter(head, max_len) for _ in range(batch)])


def load_head(name: str, directory: str, target, allow_other_target: bool = False) -> DraftHead:
    """A finished head of type ``name`` from its exported directory, checked against ``target`` (a
    Target or TargetMatrices): refused by name if it records another head type or another target."""
    check_record(directory, name)
    check_target(directory, getattr(target, "path", None), allow_other_target)
    return head_spec(name).cls.load(directory, target)
