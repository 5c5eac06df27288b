"""Which drafter decodes a trained head: an explicit map from head class to drafter constructor.

The generation loop only sees the ``Drafter`` interface; this map is the one place that knows which
drafter reads which head, and it fails loudly for a head no drafter reads.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from headstart.decode.eagle3_drafter import Eagle3Drafter
from headstart.decode.generate import Drafter
from headstart.decode.medusa_drafter import MedusaDrafter
from headstart.decode.mtp_drafter import MTPDrafter
from headstart.models.eagle3 import Eagle3Draft
from headstart.models.medusa import MedusaHeads
from headstart.models.mtp import MTPHead

DRAFTERS: dict[type, Callable[[nn.Module, int], Drafter]] = {Eagle3Draft: Eagle3Drafter, MedusaHeads: MedusaDrafter,
                                                               MTPHead: MTPDrafter}


def drafter_for(head: nn.Module, max_len: int) -> Drafter:
    """A drafter for ``head`` whose caches hold ``max_len`` positions."""
    for cls, make in DRAFTERS.items():
        if isinstance(head, cls):
            return make(head, max_len)
    raise ValueError(f"no drafter decodes a {type(head).__name__}; drafters exist for {[c.__name__ for c in DRAFTERS]}")
