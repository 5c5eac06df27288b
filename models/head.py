"""What every draft head sees (``Features``), what it declares it reads (``FeatureNeeds``) and what
the trainer asks of it (``DraftHead``).

Online capture and the offline feature store both produce ``Features``, filling exactly the fields
the head's ``needs`` ask for (the others stay None), so nothing is computed or stored that the
chosen head does not use. The trainer only calls the methods of ``DraftHead``. Everything
particular to one head stays in that head's file.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

DEFAULT_SPECULATIVE_TOKENS = 4
"""The k every headstart tool drafts unless told otherwise (benchmark, check_head, evaluation during
training), and the ``speculative_tokens`` an export tells a server: one number, so the head a server runs
is the head that was measured."""


@dataclass(frozen=True)
class DraftConfig:
    """Which head to train: the fields every head reads, and ``options``, the head's own (the ``options``
    dataclass its registry entry names). A recipe's ``draft:`` section is flat; ``trainer/config.py`` splits it
    and refuses, by name, a key that is neither shared nor the chosen head's."""

    head: str
    """Registered head name (heads/registry.py; a recipe without one gets its ``DEFAULT_HEAD``)."""
    config: str | None = None
    """Draft config JSON (server format); None derives one from the target config."""
    loss_chunk_tokens: int = 1024
    """Positions per [chunk, V] float32 logits block of the loss (every head: EAGLE-3 over V_d, Medusa and MTP over
    the full vocab); lower it to save memory."""
    loss: str = "kl"
    """What each position's draft distribution q is trained against the target's p with (``DIVERGENCES``): ``kl``
    forward KL (cross-entropy to p), ``rkl`` reverse KL, ``jsd`` Jensen-Shannon, ``tv`` total variation, ``lk``
    the LK loss -log(sum_v min(p, q)), the negative log of the acceptance rate itself (arXiv 2602.23881)."""
    options: Any = None
    """The head's own fields (e.g. ``Eagle3Options``); None: that dataclass's defaults."""
    init_from: str | None = None
    """A published head's directory (``scripts/publish_head.py``'s, or any export of this head type headstart reads)
    to start from instead of a fresh initialisation: fine-tuning a head on new data, with its vocab map kept and a
    fresh optimizer and schedule. It must be for the same target and of this recipe's shape."""

    def __post_init__(self) -> None:
        if self.loss not in DIVERGENCES:
            raise ValueError(f"draft.loss={self.loss!r} is not one of {', '.join(DIVERGENCES)}")


DIVERGENCES = ("kl", "rkl", "jsd", "tv", "lk")
"""The values of a recipe's ``draft.loss`` (models/vocab_loss.py ``divergence_sum``)."""


@dataclass(frozen=True)
class FeatureNeeds:
    """Which target tensors a head reads."""

    aux_hidden_states: bool = False
    """The residual streams at the aux layer ids (EAGLE-3)."""
    last_hidden_state: bool = False
    """The final hidden state, after the target's final norm: what its lm_head reads (Medusa, MTP)."""
    draft_vocab_logits: bool = False
    """The target's logits on the head's vocab (``target_vocab_ids``) and whether its full-vocab
    argmax lies in that vocab (EAGLE-3's soft labels)."""


@dataclass
class Features:
    input_ids: torch.Tensor  # [B, T] int64
    loss_mask: torch.Tensor  # [B, T] 1 where the token is trained (assistant tokens), 0 elsewhere and on padding
    aux_hidden_states: torch.Tensor | None = None  # [B, T, n*H_t] target residual streams at the aux layer ids
    last_hidden_state: torch.Tensor | None = None  # [B, T, H_t] the target's final (normed) hidden state
    # [B, T, V_d] the target's logits restricted to the draft vocab, and [B, T] bool whether its full-vocab argmax
    # lies in that vocab: both only at positions whose next token is trained (zeros / False elsewhere, where no loss
    # reads them: trainer/features.py teacher_at_labels).
    target_logits: torch.Tensor | None = None
    target_in_draft: torch.Tensor | None = None
    loss_denominator: float | None = None
    """What the head divides its summed loss by (``loss_denominator``). The trainer sets it to the global
    batch's trained positions per micro-batch; None: this batch's own trained positions."""
    position_ids: torch.Tensor | None = None
    """[B, T] int64 for a packed batch (trainer/batches.py): several documents per row, each one's positions
    starting at 0 (a new document starts where the position is 0). None: one sequence per row, positions 0..T-1.
    Heads read it only through ``positions``, ``documents`` and ``within_document``."""
    full_metrics: bool = True
    """Whether the loss also computes the metrics that cost a pass over every trained position's [V] logits
    besides the loss's own: the top-5 accuracy and the expected acceptance sum min(p, q). The trainer asks for them
    only on the steps it logs; the argmax accuracy (the progress bar's, and ``sim_accept_len``'s) is always kept."""

    def to(self, device: torch.device | str) -> "Features":
        def move(x):
            return x.to(device) if isinstance(x, torch.Tensor) else x

        return Features(**{f.name: move(getattr(self, f.name)) for f in fields(self)})

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def positions(self) -> torch.Tensor:
        """[B, T] rotary positions: each document's own, from 0."""
        if self.position_ids is not None:
            return self.position_ids
        B, T = self.input_ids.shape
        return torch.arange(T, device=self.input_ids.device).unsqueeze(0).expand(B, T)

    def documents(self) -> torch.Tensor | None:
        """[B, T] int64 index of the document each position belongs to (a packed batch); None when unpacked."""
        return None if self.position_ids is None else document_ids(self.position_ids)

    def within_document(self, valid: torch.Tensor, n: int) -> torch.Tensor:
        """``valid`` [B, T] bool, kept only where position t+n lies in t's document: a packed batch never supervises
        position t with a token of the next document (unpacked: ``valid`` as given, padding already masks it)."""
        return valid if self.position_ids is None else valid & same_document(self.position_ids, n)


@runtime_checkable
class DraftHead(Protocol):
    needs: ClassVar[FeatureNeeds]
    """The target tensors ``loss`` reads; the feature pipeline computes (or stores) only these."""

    def target_vocab_ids(self) -> torch.Tensor:
        """[V_d] target token id of each draft-vocab entry: which target logits ``Features`` carries."""

    def loss(self, features: Features) -> tuple[torch.Tensor, dict[str, float]]:
        """Scalar training loss and metrics (floats, already reduced over this batch).

        ``forward`` must return the same, so that sharding wrappers see the call."""

    def activation_bytes(self, tokens: int, sequences: int, element_bytes: int) -> dict[str, int]:
        """``headstart plan``'s estimate of a training step's head memory beyond its weights, by part: what the
        forward keeps for backward and the largest transient, over ``tokens`` tokens in ``sequences`` sequences
        with activations of ``element_bytes`` (4: float32; 2: bf16 autocast)."""

    def export_state_dict(self, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The tensors a server loads, under its names (from ``state``, a gathered state dict, if given)."""

    compiled: ClassVar[tuple[str, ...]]
    """Dotted paths of the parts ``train.compile`` runs through ``torch.compile`` (models/train_compile.py)."""

    layouts: tuple[str, ...]
    """The checkpoint layouts ``save_pretrained`` writes (and ``load`` reads); the first is the default."""

    def save_pretrained(self, directory: str, state_dict: dict[str, torch.Tensor] | None = None,
                        layout: str | None = None, verifier: dict | None = None) -> None:
        """Write the head in a server layout (``layout``, default ``layouts[0]``); ``verifier`` is the
        target's ``provenance.fingerprint``, for layouts whose config names the target."""


SUMS = "sum/"
"""Prefix of the sums and counts in a head's metrics (``StepTally.metrics``): the trainer adds these up over
micro-batches and ranks and forms the ratios once (``step_metrics``), so every trained token weighs the same."""
_SUM_FIELDS = ("loss", "correct", "top5", "accept", "valid", "chained", "chain_valid")


class StepTally:
    """One batch of a multi-step head (EAGLE-3's TTT steps, Medusa's heads, MTP's unrolled steps), step by step:
    step s at position t predicts token t+2+s. Kept as sums and counts on the device; one host transfer at the end.

    ``chained`` counts the positions whose steps 0..s are all right, among ``chain_valid``, those trained at every
    step 0..s: the simulated acceptance length 1 + sum_s chained_s / chain_valid_s is then the expected length of
    a greedy chain under teacher forcing, by one definition for every head."""

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []
        self.chain: torch.Tensor | None = None  # [B, T] bool: steps 0..s all right at t
        self.chain_valid: torch.Tensor | None = None

    def add(self, valid: torch.Tensor, b: torch.Tensor, t: torch.Tensor, loss_sum: torch.Tensor, correct: torch.Tensor,
            top5: torch.Tensor | None = None, accept: torch.Tensor | None = None) -> None:
        """Step s's trained positions ``valid`` [B, T] (``b``, ``t``: their indices), its summed loss and, per trained
        position, whether the draft's argmax is the target's (``correct``), in its top 5, and sum min(p, q)."""
        right = torch.zeros_like(valid)
        right[b, t] = correct
        self.chain = right if self.chain is None else self.chain & right
        self.chain_valid = valid if self.chain_valid is None else self.chain_valid & valid
        nan = torch.full((), float("nan"), device=valid.device)
        self.rows.append(torch.stack([loss_sum.detach().float(), correct.sum().float(),
                                      nan if top5 is None else top5.sum().float(), nan if accept is None else accept.sum().float(),
                                      valid.sum().float(), self.chain.sum().float(), self.chain_valid.sum().float()]))

    def metrics(self, loss_mask: torch.Tensor) -> dict[str, float]:
        """The sums (``SUMS`` keys), the ratios they give for this batch alone, and ``valid_tokens``."""
        *rows, (n_tokens, *_) = torch.cat([torch.stack(self.rows), loss_mask.sum().float().expand(1, len(_SUM_FIELDS))]).tolist()
        sums = {f"{SUMS}{name}_{s}": v for s, row in enumerate(rows) for name, v in zip(_SUM_FIELDS, row) if v == v}  # no NaN
        return {**step_metrics(sums), **sums, "valid_tokens": n_tokens}


def layer_activation_bytes(tokens: int, hidden: int, intermediate: int, element_bytes: int) -> int:
    """What one decoder layer's forward keeps for backward, per the usual count for a Llama-style layer: per token
    about 12 hidden-wide tensors (input, two norms, q, k, v, attention output, o_proj output, residuals) and 3
    intermediate-wide ones (the MLP's gate, up and activation). A rule of thumb, within a few tens of percent."""
    return tokens * (12 * hidden + 3 * intermediate) * element_bytes


def loss_chunk_bytes(chunk_tokens: int, vocab: int, tokens: int) -> int:
    """The chunked vocab loss's peak: one [chunk, vocab] float32 block of logits, its softmax and its gradient."""
    return min(chunk_tokens, tokens) * vocab * 4 * 3


def step_metrics(sums: dict[str, float]) -> dict[str, float]:
    """Per-step means from summed ``StepTally`` counts: loss_s, acc_s, top5_s, accept_s and sim_accept_len."""
    out: dict[str, float] = {}
    sim_len, s = 1.0, 0
    while f"{SUMS}valid_{s}" in sums:
        n = max(sums[f"{SUMS}valid_{s}"], 1.0)
        out[f"loss_{s}"], out[f"acc_{s}"] = sums[f"{SUMS}loss_{s}"] / n, sums[f"{SUMS}correct_{s}"] / n
        for name in ("top5", "accept"):
            if f"{SUMS}{name}_{s}" in sums:
                out[f"{name}_{s}"] = sums[f"{SUMS}{name}_{s}"] / n
        sim_len += sums[f"{SUMS}chained_{s}"] / max(sums[f"{SUMS}chain_valid_{s}"], 1.0)
        s += 1
    out["sim_accept_len"] = sim_len  # comparable to tau: the bonus token included
    return out


def check_layout(head, layout: str | None) -> str:
    """``layout``, or the head's default when None; refused by name if the head cannot write it."""
    if layout is None:
        return head.layouts[0]
    if layout not in head.layouts:
        raise ValueError(f"{type(head).__name__} is exported in the layouts {list(head.layouts)}, not {layout!r}")
    return layout


def trained_positions(loss_mask: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Trained tokens that have a position before them in their sequence: what a training loss is averaged over.
    ``position_ids`` [B, T] of a packed batch (each document from 0); None: one sequence per row. [] int64"""
    if position_ids is None:
        return loss_mask[:, 1:].sum()
    return (loss_mask.bool() & (position_ids > 0)).sum()


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] positions, each document's from 0 -> [B, T] int64 index of each position's document in its row."""
    return (position_ids == 0).long().cumsum(1)


def same_document(position_ids: torch.Tensor, n: int) -> torch.Tensor:
    """[B, T] bool: position t+n exists and lies in t's document."""
    docs = document_ids(position_ids)
    return shift_left(docs, n, -1) == docs


def loss_denominator(f: Features) -> torch.Tensor | float:
    """A head's loss is sum over steps of step_weight**k x (summed loss of step k) / this.

    In training it is the global batch's trained positions divided by its micro-batches (ranks x
    grad_accum), so that after the backends average over those the gradient is the global batch's
    token mean: every trained token weighs the same whichever rank, micro-batch or sequence length
    it comes in, and the step is the same however the global batch is split (resume on another world
    size). Outside the trainer: this batch's own trained positions."""
    if f.loss_denominator is not None:
        return f.loss_denominator
    return trained_positions(f.loss_mask, f.position_ids).clamp(min=1)


def shift_left(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    """x[:, t] <- x[:, t + n], filling the last n positions (dim 1) with ``fill``: what position t
    predicts n tokens ahead (EAGLE-3's and MTP's unrolled steps)."""
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out
