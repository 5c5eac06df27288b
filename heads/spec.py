"""``HeadSpec``: everything headstart asks of one kind of head. Each head's folder fills one (``heads/<name>/spec.py``)
and the catalog (heads/registry.py) lists them; the trainer, the feature pipeline, the decoder's method catalog,
``check_head``, ``publish_head`` and the export tools read a head only through its spec."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from headstart.decode.drafter import Capabilities, Drafter
from headstart.models.head import DraftConfig, DraftHead


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
    drafter: type[Drafter]
    """(finished head, cache length, compile=False, backend=) -> the decoder's drafter for it: a ``Drafter`` for one
    sequence (decode/generate.py) and, where its capabilities say ``batches``, a ``BatchDrafter`` for a batch of any
    size (decode/batch_generate.py); ``compile``: its draft step through ``torch.compile`` where it declares ``compiled``.
    Its class declares what it can do (``capabilities``)."""
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
    decoded_by: str | None = None
    """The drafting method (decode/methods.py) that decodes this head's exports, when that is not a method of its own:
    a distilled draft model is a plain causal LM, which ``draft-model`` decodes like any other. None: ``--method``
    takes the head's catalog name."""
    trained_depth: Callable[[dict], int | None] | None = None
    """(export's config.json) -> the drafts per round the export was made for (more is warned about); None: no limit."""
    learns_online: bool = False
    """Its loss reads only what a decoder's verify passes give -- the target's aux and final hidden states at the served
    tokens, and the logits projected from the final ones -- so it learns as it serves (``--online``: trainer/online.py)
    and from a server's request log (``headstart adapt``). False: both refuse it by name."""
    tiny: dict[str, Any] = field(default_factory=dict)
    """The ``draft:`` fields of a small instance for a tiny target (a few hundred tokens, 8 layers: a draft vocab and
    a depth it fits), which the conformance suite builds, trains, exports and decodes (tests/test_catalog.py)."""

    @property
    def capabilities(self) -> Capabilities:
        """What its drafter declares it can do (decode/drafter.py): read before any weight loads."""
        return self.drafter.capabilities
