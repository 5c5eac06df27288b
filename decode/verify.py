"""Chain verification: which of k drafted tokens the target accepts, and the token it emits next.

Both rules are vectorised over the batch and the chain: no Python loop over candidates and no
host sync. Greedy reproduces the target's greedy decoding exactly; rejection sampling (Leviathan
et al. 2023; Chen et al. 2023) reproduces the target's sampling distribution exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def warp_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Sampling distribution [..., V] after temperature, top-k and top-p (the same warp on target and draft)."""
    if temperature <= 0:
        raise ValueError("temperature must be > 0 for sampling; use greedy verification for temperature 0")
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p  # keep the smallest set reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.softmax(logits, dim=-1)


def _proposed(draft_tokens: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """[B, k] True where row b has a real draft (a batch pads shorter chains to the longest one)."""
    k = draft_tokens.shape[1]
    if lengths is None:
        return torch.ones_like(draft_tokens, dtype=torch.bool)
    return torch.arange(k, device=draft_tokens.device) < lengths[:, None]


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor,
                  lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_tokens [B, k], target_logits [B, k+1, V] (position i scores the token after draft i-1); ``lengths``
    [B]: row b's real drafts (the rest is padding, never accepted).

    Returns (accepted [B] in 0..k, next_token [B]): the longest prefix equal to the target's argmax,
    then the target's argmax at the first mismatch (or after the last draft: the bonus token)."""
    target = target_logits.argmax(-1)  # [B, k+1]
    k = draft_tokens.shape[1]
    match = (draft_tokens == target[:, :k]) & _proposed(draft_tokens, lengths)
    accepted = match.long().cumprod(dim=1).sum(dim=1)  # [B]
    return accepted, target.gather(1, accepted[:, None]).squeeze(1)


def verify_sampling(
    draft_tokens: torch.Tensor,  # [B, k]
    draft_probs: torch.Tensor,  # [B, k, V] q: the distributions the drafts were sampled from
    target_probs: torch.Tensor,  # [B, k+1, V] p: the target's (warped) distributions
    generator: torch.Generator | None = None,
    lengths: torch.Tensor | None = None,  # [B] row b's real drafts; its padding (q = 0 there) is never accepted
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept draft i with probability min(1, p(x)/q(x)); at the first rejection sample from
    norm(max(p - q, 0)); if all k are accepted sample the bonus from p at position k.
    Returns (accepted [B] in 0..k, next_token [B])."""
    B, k = draft_tokens.shape
    p_x = target_probs[:, :k].gather(2, draft_tokens[..., None]).squeeze(-1)  # [B, k]
    q_x = draft_probs.gather(2, draft_tokens[..., None]).squeeze(-1)
    u = torch.rand(B, k, generator=generator, device=draft_tokens.device)
    ok = (u * q_x < p_x) & _proposed(draft_tokens, lengths)  # u < p/q without dividing by q = 0
    accepted = ok.long().cumprod(dim=1).sum(dim=1)  # [B]
    # Residual at the first rejection; at position k (all accepted) q is zero, so the residual is p.
    q_pad = torch.cat([draft_probs, draft_probs.new_zeros(B, 1, draft_probs.shape[-1])], dim=1)  # [B, k+1, V]
    idx = accepted[:, None, None].expand(B, 1, target_probs.shape[-1])
    residual = (target_probs.gather(1, idx) - q_pad.gather(1, idx)).clamp(min=0).squeeze(1)  # [B, V]
    mass = residual.sum(-1, keepdim=True)
    # p == q exactly leaves no residual mass; then any sample from p is correct.
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), target_probs.gather(1, idx).squeeze(1))
    next_token = torch.multinomial(residual, 1, generator=generator).squeeze(1)
    return accepted, next_token


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters; the target's distribution is warped by them, and speculation preserves it."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return warp_probs(logits, self.temperature, self.top_k, self.top_p)
