"""Draft & Verify (Zhang et al., ACL 2024): the target drafts for itself with some of its decoder layers skipped -- no
draft model, no training -- and verifies the drafts with all of them, so greedy output is the target's own and
sampling stays lossless (q is the skipping model's distribution).

A round from bonus token x: x, d_1, ..., d_{k-1} each run through the kept layers at the slots after the committed
tokens (``TargetRunner.forward_skipping``), on the target's own KV cache: the kept layers read the committed context's
K/V that verification wrote. Verification is the full forward over [x, d_1, ..., d_k], which overwrites every slot
drafting wrote. Which layers to skip is a search on held-out text (``layer_skip_search``: each skip set's drafts'
top-1 agreement with the full model). Chains only, one sequence: it drafts on the target's cache.
"""

from __future__ import annotations

import time

import torch

from headstart.decode.chain import SelfDraftChain
from headstart.decode.drafter import Capabilities
from headstart.models.target import Target, TargetOutput


def parse_skip(text: str, num_layers: int) -> frozenset[int]:
    """``--skip-layers`` ("3,5,7-12") as layer indices, refused by name where one is out of range or none is left."""
    skip: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"--skip-layers {text!r}: comma-separated layer indices or ranges (\"3,5,7-12\")") from None
        skip.update(range(first, last + 1))
    if not skip:
        raise ValueError("--skip-layers names no layer: the draft would be the target itself")
    outside = sorted(i for i in skip if not 0 <= i < num_layers)
    if outside:
        raise ValueError(f"--skip-layers {text}: the target has layers 0..{num_layers - 1}, not {outside}")
    if len(skip) == num_layers:
        raise ValueError(f"--skip-layers {text}: every one of the target's {num_layers} layers skipped leaves no draft "
                         "model (keep at least one)")
    return frozenset(skip)


class LayerSkipDrafter(SelfDraftChain):
    # Chains on the target's own runner and cache, verified by the full forward it runs itself; eager, one sequence.
    capabilities = Capabilities(sampled=True, confidence=True, self_verify=True)

    def __init__(self, skip: frozenset[int]) -> None:
        self.skip = skip
        self.what = "the layer-skip drafter"
        self.confidence_threshold = 0.0

    def attach(self, runner) -> None:
        if max(self.skip) >= runner.target.num_layers:
            raise ValueError(f"skip set {sorted(self.skip)} is for a deeper target than this one "
                             f"({runner.target.num_layers} layers)")
        super().attach(runner)
        self.target_vocab_size = runner.target.vocab_size

    def chain_room(self, k: int) -> int:
        return self.start_round(k)

    def chain_logits(self, i: int, previous: torch.Tensor | None) -> torch.Tensor:
        token = torch.tensor([[self.bonus]], device=self.device) if previous is None else previous.view(1, 1)
        return self.runner.forward_skipping(token, self.skip, self._start + i)[0, -1].float()

    def verify(self, block: torch.Tensor) -> tuple[torch.Tensor, TargetOutput]:
        """All layers over the round's block [1, 1 + k'] at the slot drafting started from."""
        self.check_slot()
        return self.runner.forward(block)


@torch.no_grad()
def agreement(target: Target, sequences: list[torch.Tensor], skip: frozenset[int], full: list[torch.Tensor]) -> float:
    """The share of positions where the target with ``skip`` left out predicts the full target's next token (its
    greedy choice, ``full``), teacher-forced over ``sequences``: the chance a greedy draft is accepted."""
    hits = total = 0
    for ids, want in zip(sequences, full):
        hidden = target.skipping_layers(ids, skip, None, None)
        hits += int((target.logits(hidden).argmax(-1) == want).sum())
        total += want.numel()
    return hits / total


@torch.no_grad()
def layer_skip_search(target: Target, sequences: list[torch.Tensor], skip_count: int, candidates: int = 8,
                      progress=None) -> dict[str, object]:
    """A greedy search of the skip set: every layer is first scored skipped alone (``agreement``); then, from none
    skipped, each step skips the one more layer that keeps the highest agreement, tried among the ``candidates`` layers
    missed least when skipped alone, until ``skip_count`` are skipped. -> the set, the agreement at each step, the
    target forwards it ran and the seconds it took."""
    layers = target.num_layers
    if not 0 < skip_count < layers:
        raise ValueError(f"--skip {skip_count}: skip between 1 and {layers - 1} of the target's {layers} layers")
    if candidates < 1:
        raise ValueError(f"--candidates {candidates}: at least 1 layer tried a step")
    began = time.perf_counter()
    full = [target.logits(target.skipping_layers(ids, frozenset(), None, None)).argmax(-1) for ids in sequences]
    alone = {i: agreement(target, sequences, frozenset({i}), full) for i in range(layers)}
    ranked = sorted(alone, key=lambda i: (-alone[i], i))  # missed least first
    skip, path, forwards = frozenset({ranked[0]}), [], 1 + layers
    path.append({"skip": sorted(skip), "agreement": round(alone[ranked[0]], 4)})
    while len(skip) < skip_count:
        tried = [i for i in ranked if i not in skip][:candidates]
        scored = [(agreement(target, sequences, skip | {i}, full), -i) for i in tried]
        forwards += len(scored)
        best, neg = max(scored)
        skip = skip | {-neg}
        path.append({"skip": sorted(skip), "agreement": round(best, 4)})
        if progress is not None:
            progress(f"{len(skip)} skipped: layer {-neg}, agreement {best:.3f}")
    return {"skip_layers": sorted(skip), "agreement": path[-1]["agreement"], "path": path, "forwards": forwards,
            "tokens": int(sum(ids.numel() for ids in sequences)), "seconds": round(time.perf_counter() - began, 1),
            "num_layers": layers, "candidates": candidates,
            "alone": {str(i): round(alone[i], 4) for i in range(layers)}}
