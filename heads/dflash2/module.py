"""DFlash2 (z-lab / Inco AI, 2026): DFlash (heads/dflash) with two grouped dynamic causal convolutions in each layer and
a candidate selector that re-ranks each slot's top-k tokens given the token drafted before it.

    layer:    h = input_layernorm(x); taps = kernel_projection(h)          per position: 2 sides x T taps x G groups
              a = self_attn(conv_0(h)); x = x + conv_1(a)                  the attention between the two sides
              h = post_attention_layernorm(x); taps = ...; x = x + conv_1(mlp(conv_0(h)))
    conv_s:   y[t, c] = sum_{j < T} (base_kernel[s, j, c] + taps[t, s, j, c // group]) x[t - j, c], over the block's own
              slots only (slot t - j of the same block; none before its first)
    unary     = lm_head(norm(out_i))                                          slot i (>= 1) drafts token p+i, as DFlash
    selector: candidates = top-k(unary); score_c = unary_c + <P[prev] * W h_i, S[c]>, prev the token drafted before
              (the bonus for slot 1, the data's token in training); the draft is the best-scored candidate

Training: DFlash's block loss (the unary logits against the target, D-PACE or decay weights) plus ``selector_alpha`` x
the selector's cross-entropy over the k candidates towards the target's greedy token, with the same weights, where that
token is among them, the previous tokens teacher forced (SpecForge's ``dflash_family_model`` aims at the data's token:
on the target's own replies the two agree, and the target's token is the one greedy verification accepts). At initialisation both convolutions are the identity (base tap 0 = 1,
no dynamic taps) and the selector adds nothing (successor codebook 0): a fresh DFlash2 head drafts as a DFlash head
with the same layers. Saved under z-lab's names; the codebooks without ``.weight`` (docs/FORMATS.md section M).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from headstart.heads.dflash.module import DFlashDraft, DFlashLayer, block_config
from headstart.heads.dflash2.config import DFlash2Config, DFlash2Options
from headstart.models.head import DraftConfig, Features, loss_denominator
from headstart.models.target import text_config
from headstart.models.vocab_loss import lockstep_chunks


class GroupedDynamicCausalConv(nn.Module):
    """Two sides (before and after the attention or the MLP) of a T-tap causal convolution over a block's slots, each
    tap a static per-channel weight plus a per-position, per-group weight computed from the layer's normed input."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.groups = hidden_size // group_size
        base = torch.zeros(2, kernel_size, hidden_size)
        base[:, 0] = 1.0  # the identity until trained
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def taps(self, h: torch.Tensor) -> torch.Tensor:
        """The dynamic taps of normed inputs h [B, n, H]: [B, n, 2, T, G]."""
        return self.kernel_projection(h).view(*h.shape[:-1], 2, self.kernel_size, self.groups)

    def forward(self, x: torch.Tensor, side: int, taps: torch.Tensor) -> torch.Tensor:
        """Side ``side`` over x [B, n, H], n = whole blocks laid end to end (training) or one block (decoding)."""
        B, n, H = x.shape
        grouped = x.view(B, n, self.groups, self.group_size)
        slot = torch.arange(n, device=x.device) % self.block_size
        out = torch.zeros_like(grouped)
        for j in range(self.kernel_size):
            past = grouped if j == 0 else F.pad(grouped[:, : n - j], (0, 0, 0, 0, j, 0))  # x[t - j]
            if j:
                past = past * (slot >= j).to(x.dtype)[None, :, None, None]  # not across a block's first slot
            weight = self.base_kernel[side, j].view(self.groups, self.group_size).to(x.dtype) \
                + taps[:, :, side, j, :, None].to(x.dtype)
            out = out + weight * past
        return out.view(B, n, H)


class DFlash2Layer(DFlashLayer):
    """DFlash's layer with a convolution around its attention and another around its MLP."""

    def __init__(self, config: DFlash2Config) -> None:
        super().__init__(config)
        make = lambda: GroupedDynamicCausalConv(config.hidden_size, config.conv_kernel_size,  # noqa: E731
                                                config.conv_group_size, config.block_size)
        self.attention_conv, self.mlp_conv = make(), make()

    def forward(self, x, context, cos, sin, allowed):
        h = self.input_layernorm(x)
        taps = self.attention_conv.taps(h)
        x = x + self.attention_conv(self.self_attn(self.attention_conv(h, 0, taps), context, cos, sin, allowed), 1, taps)
        h = self.post_attention_layernorm(x)
        taps = self.mlp_conv.taps(h)
        return x + self.mlp_conv(self.mlp(self.mlp_conv(h, 0, taps)), 1, taps)


class CandidateSelector(nn.Module):
    """Re-ranks a slot's top-k unary candidates by a low-rank score of (previous token, slot state, candidate)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * 0.02)
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))  # adds nothing until trained
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        nn.init.normal_(self.hidden_projection.weight, std=0.02)

    def scores(self, h: torch.Tensor, unary: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot states h [m, H], their unary logits [m, V] and previous tokens [m] -> (candidates [m, k], scores
        [m, k])."""
        top, candidates = unary.topk(self.top_k, dim=-1)
        pair = self.predecessor_codebook[prev] * self.hidden_projection(h.to(self.hidden_projection.weight.dtype))
        return candidates, top + torch.einsum("mr,mkr->mk", pair, self.successor_codebook[candidates]).float()

    def logits(self, h: torch.Tensor, unary: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The scores over the whole vocab [m, V]: -inf outside the candidates."""
        candidates, scores = self.scores(h, unary, prev)
        return torch.full_like(unary, float("-inf")).scatter(-1, candidates, scores)


class DFlash2Draft(DFlashDraft):
    """DFlash's network with the convolutions in its layers and the candidate selector."""

    layouts = ("dflash2",)  # docs/FORMATS.md section M
    layer_class = DFlash2Layer
    config_class = DFlash2Config

    def __init__(self, config: DFlash2Config, anchors: int = 64, decay_gamma: float = 4.0, weighting: str = "dpace",
                 dpace_alpha: float = 0.5, selector_alpha: float = 1.0) -> None:
        super().__init__(config, anchors=anchors, decay_gamma=decay_gamma, weighting=weighting, dpace_alpha=dpace_alpha)
        if selector_alpha < 0:
            raise ValueError(f"draft.selector_alpha must be >= 0, got {selector_alpha}")
        self.selector_alpha = selector_alpha
        self.candidate_selector = CandidateSelector(config.vocab_size, config.hidden_size, config.selector_rank,
                                                    config.selector_top_k)

    def loss(self, f: Features) -> tuple[torch.Tensor, dict[str, float]]:
        blocks = self.block_drafts(f)
        project = self.projection()
        weights = self.draft_weights(project, blocks, f)
        total, metrics = self.block_loss(blocks, project, weights, f)
        denominator = loss_denominator(f)
        picked = covered = count = 0
        for j in range(1, self.drafts_per_block + 1):
            b, n = blocks.trained[j - 1].nonzero(as_tuple=True)
            a = blocks.anchors[b, n]
            w = weights[b, n, j - 1] if weights is not None else torch.full((len(b),), self.decay(j), device=a.device)
            ce, right, inside = chunked_selector_loss(self, blocks.drafts[b, n, j - 1], f.input_ids[b, a + j - 1],
                                                      f.last_hidden_state[b, a + j - 1], w, self.chunk_tokens)
            total = total + self.selector_alpha * ce / denominator
            picked, covered, count = picked + right, covered + inside, count + len(b)
        # how often the selector's pick is the target's token, and how often that token is among the candidates at all
        metrics["selector_acc"] = float(picked) / max(count, 1)
        metrics["selector_in_topk"] = float(covered) / max(count, 1)
        return total, metrics


def chunked_selector_loss(head: DFlash2Draft, x: torch.Tensor, prev: torch.Tensor, teacher_h: torch.Tensor,
                          weights: torch.Tensor, chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One slot's selector term over n blocks, ``chunk_tokens`` at a time (each chunk's [n, V] unary logits recomputed
    in backward), towards the target's greedy token (its final state ``teacher_h``'s argmax): (weighted CE sum, picks
    that are that token, blocks where it is among the candidates)."""
    total = torch.zeros((), device=x.device)
    right = inside = torch.zeros((), dtype=torch.long, device=x.device)
    for c in range(lockstep_chunks(x.shape[0], chunk_tokens, x.device)):
        part = slice(c * chunk_tokens, (c + 1) * chunk_tokens)
        args = (head, x[part], prev[part], teacher_h[part], weights[part])
        ce, r, i = checkpoint(_selector_chunk, *args, use_reentrant=False) if torch.is_grad_enabled() \
            else _selector_chunk(*args)
        total, right, inside = total + ce, right + r, inside + i
    return total, right, inside


def _selector_chunk(head: DFlash2Draft, x, prev, teacher_h, weights):
    with torch.no_grad():
        labels = head.lm_head(teacher_h).argmax(-1)
    h = head.norm(x)
    unary = head.lm_head(h.to(head.lm_head_dtype)).float()
    candidates, scores = head.candidate_selector.scores(h, unary, prev)
    hit = candidates == labels[:, None]  # [n, k]: at most one per row
    inside = hit.any(-1)
    ce = F.cross_entropy(scores, hit.float().argmax(-1), reduction="none")
    picked = candidates.gather(1, scores.detach().argmax(-1, keepdim=True)).squeeze(1) == labels
    return (ce * weights * inside).sum(), picked.sum(), inside.sum()


def build_dflash2(draft: DraftConfig, target, token_counts: torch.Tensor | None = None) -> DFlash2Draft:
    """A fresh DFlash2 head for ``target`` (the token counts are not used: it predicts the target's whole vocab)."""
    options: DFlash2Options = draft.options or DFlash2Options()
    config = block_config(DFlash2Config, dataclasses.replace(draft, options=options), target,
                          conv_kernel_size=options.conv_kernel_size, conv_group_size=options.conv_group_size,
                          selector_rank=options.selector_rank,
                          selector_top_k=min(options.selector_top_k, text_config(target.config).vocab_size))
    head = DFlash2Draft(config, anchors=options.anchors, decay_gamma=options.decay_gamma, weighting=options.weighting,
                        dpace_alpha=options.dpace_alpha, selector_alpha=options.selector_alpha)
    head.chunk_tokens, head.divergence = draft.loss_chunk_tokens, draft.loss
    head.set_target(target)
    return head
