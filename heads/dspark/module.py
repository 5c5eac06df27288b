"""DSpark (DeepSpec, 2026): a DFlash block drafter (heads/dflash) plus a low-rank Markov logit bias from each draft's
previous token and a confidence head that predicts each draft's acceptance.

    out_j    = the DFlash layers' output at block slot j-1: [bonus, MASK x (B-1)] at positions p..p+B-1; slot i predicts
               the token after its own position, so a block drafts B tokens (``first_draft_slot = 0``)
    h_j      = norm(out_j)
    logits_j = lm_head(h_j) + W2 W1[prev_j]          prev_1 = the bonus token, prev_j = draft j-1 (the data's token
                                                     a+j-1 in training: teacher forced)
    c_j      = sigmoid(w . [h_j; W1[prev_j]] + b)     the predicted chance that draft j is accepted

Training (per draft j of each anchor's block, weighted exp(-(j-1)/gamma), only the contiguous prefix of trained
tokens): ``ce_alpha`` CE(logits_j, data token a+j) + ``l1_alpha`` sum |p - q| (target p, draft q) + ``confidence_alpha``
BCE(c_j, 1 - TV(p, q)) with the label detached -- DeepSpec's ``dspark/loss.py``, over ``loss_denominator`` tokens as
every head here. The embedding and lm_head are the target's, frozen and not saved; the Markov and confidence heads are
saved under DeepSpec's names (``markov_head.markov_w1/markov_w2``, ``confidence_head.proj``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from headstart.heads.dflash.module import BlockDrafts, DFlashDraft, block_config
from headstart.heads.dspark.config import DSparkConfig, DSparkOptions
from headstart.models.head import DraftConfig, Features, StepTally, loss_denominator
from headstart.models.vocab_loss import lockstep_chunks


class MarkovHead(nn.Module):
    """The previous token's low-rank logit bias: W2 W1[prev] (``vanilla``), or its rank-r code gated by the slot's state
    (``gated``). DeepSpec's ``VanillaMarkov``/``GatedMarkovHead`` tensors."""

    def __init__(self, vocab_size: int, rank: int, kind: str, hidden_size: int) -> None:
        super().__init__()
        self.kind = kind
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        self.gate_proj = nn.Linear(hidden_size + rank, rank) if kind == "gated" else None

    def code(self, prev: torch.Tensor) -> torch.Tensor:
        """W1[prev]: [..., r] (also what the confidence head reads)."""
        return self.markov_w1(prev)

    def bias(self, code: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The logit bias [..., V] of a previous token's ``code`` at a slot of state ``h`` [..., H]."""
        if self.gate_proj is not None:
            code = torch.sigmoid(self.gate_proj(torch.cat([h.to(code.dtype), code], -1))) * code
        return self.markov_w2(code)


class AcceptRatePredictor(nn.Module):
    """The confidence head: a logit of the chance a draft is accepted, from its slot's state (and W1[prev])."""

    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


class DSparkDraft(DFlashDraft):
    """DFlash's layers, with the Markov head and the confidence head."""

    layouts = ("dspark",)  # docs/FORMATS.md section L
    config_class = DSparkConfig
    first_draft_slot = 0

    def __init__(self, config: DSparkConfig, anchors: int = 64, decay_gamma: float = 4.0, ce_alpha: float = 0.1,
                 l1_alpha: float = 0.9, confidence_alpha: float = 1.0) -> None:
        super().__init__(config, anchors=anchors, decay_gamma=decay_gamma, weighting="decay")
        if min(ce_alpha, l1_alpha, confidence_alpha) < 0 or ce_alpha + l1_alpha == 0:
            raise ValueError(f"DSpark loss weights must be >= 0 with ce_alpha + l1_alpha > 0, got ce_alpha={ce_alpha}, "
                             f"l1_alpha={l1_alpha}, confidence_alpha={confidence_alpha}")
        self.ce_alpha, self.l1_alpha, self.confidence_alpha = ce_alpha, l1_alpha, confidence_alpha
        H, r = config.hidden_size, config.markov_rank
        self.markov_head = MarkovHead(config.vocab_size, r, config.markov_head_type, H) if r > 0 else None
        self.confidence_head = (AcceptRatePredictor(H + (r if config.confidence_head_with_markov else 0))
                                if config.enable_confidence_head else None)
        for module in (self.markov_head, self.confidence_head):  # HF's initializer_range: both start near zero
            for p in () if module is None else module.parameters():
                nn.init.normal_(p, std=0.02) if p.dim() > 1 else nn.init.zeros_(p)

    # -- one slot's outputs, as training and the drafter compute them ----------------------------------------
    def code(self, prev: torch.Tensor) -> torch.Tensor | None:
        return None if self.markov_head is None else self.markov_head.code(prev)

    def slot_logits(self, h: torch.Tensor, code: torch.Tensor | None, unary: torch.Tensor | None = None) -> torch.Tensor:
        """Normed slot states h [n, H] and their previous tokens' codes -> Markov-corrected logits [n, V] (float);
        ``unary``: their lm_head logits where already computed (the drafter's block)."""
        logits = self.lm_head(h.to(self.lm_head_dtype)).float() if unary is None else unary
        return logits if code is None else logits + self.markov_head.bias(code, h).float()

    def confidence(self, h: torch.Tensor, code: torch.Tensor | None) -> torch.Tensor | None:
        """The confidence head's logits [n] (None: the head has none)."""
        if self.confidence_head is None:
            return None
        x = h if not self.config.confidence_head_with_markov else torch.cat([h, code.to(h.dtype)], -1)
        return self.confidence_head(x).float()

    # -- training -------------------------------------------------------------------------------------------
    def loss(self, f: Features) -> tuple[torch.Tensor, dict[str, float]]:
        blocks = self.block_drafts(f)
        B, T = f.input_ids.shape
        device = f.input_ids.device
        trained, ok = [], torch.ones_like(blocks.trained[0])
        for t in blocks.trained:  # DeepSpec's eval_mask: a draft counts only after trained drafts (a chain's prefix)
            ok = ok & t
            trained.append(ok)
        blocks = BlockDrafts(blocks.anchors, blocks.drafts, trained)
        denominator = loss_denominator(f)
        total = torch.zeros((), dtype=torch.float32, device=device)
        tally, confidence_error, confidence_n = StepTally(), torch.zeros((), device=device), 0
        for j in range(1, self.drafts_per_block + 1):
            b, n = trained[j - 1].nonzero(as_tuple=True)
            a = blocks.anchors[b, n]
            terms, correct, top5, accept, error = chunked_dspark_loss(
                self, blocks.drafts[b, n, j - 1], f.input_ids[b, a + j - 1], f.last_hidden_state[b, a + j - 1],
                f.input_ids[b, a + j], self.chunk_tokens)
            step_sum = self.ce_alpha * terms[0] + self.l1_alpha * terms[1] + self.confidence_alpha * terms[2]
            total = total + self.decay(j) * step_sum / denominator
            confidence_error, confidence_n = confidence_error + error, confidence_n + len(b)
            at = torch.zeros(B, T, dtype=torch.bool, device=device)
            at[b, a] = True
            tally.add(at, b, a, step_sum, correct, top5=top5, accept=accept)
        metrics = tally.metrics(f.loss_mask)
        if self.confidence_head is not None:  # how far the predicted acceptance is from 1 - TV, on average
            metrics["confidence_abs_error"] = float(confidence_error) / max(confidence_n, 1)
        return total, metrics


def chunked_dspark_loss(head: DSparkDraft, x: torch.Tensor, prev: torch.Tensor, teacher_h: torch.Tensor,
                        labels: torch.Tensor, chunk_tokens: int):
    """One draft slot's DSpark terms over n blocks, ``chunk_tokens`` at a time, each chunk's [n, V] logits recomputed in
    backward: ((CE sum, L1 sum, BCE sum), argmax right [n], target's argmax in top 5 [n], sum min(p, q) [n], summed
    |confidence - (1 - TV)|)."""
    N = x.shape[0]
    sums = torch.zeros(3, device=x.device)
    correct, top5, accept = [], [], []
    error = torch.zeros((), device=x.device)
    for c in range(lockstep_chunks(N, chunk_tokens, x.device)):
        part = slice(c * chunk_tokens, (c + 1) * chunk_tokens)
        args = (head, x[part], prev[part], teacher_h[part], labels[part])
        out = checkpoint(_chunk, *args, use_reentrant=False) if torch.is_grad_enabled() else _chunk(*args)
        chunk_sums, chunk_correct, chunk_top5, chunk_accept, chunk_error = out
        sums = sums + chunk_sums
        correct.append(chunk_correct)
        top5.append(chunk_top5)
        accept.append(chunk_accept)
        error = error + chunk_error
    return sums, torch.cat(correct), torch.cat(top5), torch.cat(accept), error


def _chunk(head: DSparkDraft, x, prev, teacher_h, labels):
    with torch.no_grad():
        target_logits = head.lm_head(teacher_h).float()
        p = torch.softmax(target_logits, -1)
        target_top1 = target_logits.argmax(-1)
    h = head.norm(x)
    code = head.code(prev)
    logq = torch.log_softmax(head.slot_logits(h, code), -1)
    q = logq.exp()
    l1 = (p - q).abs().sum(-1)  # [n]: 2 TV(p, q)
    accepted = (1 - 0.5 * l1).clamp(0, 1)  # sum min(p, q): the chance a draft sampled from q is accepted
    ce = F.nll_loss(logq, labels, reduction="sum")
    confidence = head.confidence(h, code)
    bce = error = torch.zeros((), device=x.device)
    if confidence is not None:
        bce = F.binary_cross_entropy_with_logits(confidence, accepted.detach(), reduction="sum")
        error = (torch.sigmoid(confidence) - accepted).abs().sum().detach()
    draft = logq.detach()
    top5 = (draft.topk(min(5, draft.shape[-1]), -1).indices == target_top1[:, None]).any(-1)
    return torch.stack([ce, l1.sum(), bce]), draft.argmax(-1) == target_top1, top5, accepted.detach(), error


def build_dspark(draft: DraftConfig, target, token_counts: torch.Tensor | None = None) -> DSparkDraft:
    """A fresh DSpark head for ``target`` (the token counts are not used: it predicts the target's whole vocab)."""
    options: DSparkOptions = draft.options or DSparkOptions()
    if draft.loss != "kl":
        raise ValueError(f"draft.loss={draft.loss!r}: a DSpark head trains its own terms (draft.ce_alpha, draft.l1_alpha, "
                         "draft.confidence_alpha); leave draft.loss unset")
    config = block_config(DSparkConfig, dataclasses.replace(draft, options=options), target,
                          markov_rank=options.markov_rank, markov_head_type=options.markov_head_type,
                          enable_confidence_head=options.confidence_head,
                          confidence_head_with_markov=options.confidence_head and options.confidence_head_with_markov)
    head = DSparkDraft(config, anchors=options.anchors, decay_gamma=options.decay_gamma, ce_alpha=options.ce_alpha,
                       l1_alpha=options.l1_alpha, confidence_alpha=options.confidence_alpha)
    head.chunk_tokens = draft.loss_chunk_tokens
    head.set_target(target)
    return head

