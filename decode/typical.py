"""Typical acceptance (Cai et al., "Medusa", 2024, section 2.3.1): keep a draft the target finds typical enough.

A draft x is kept where the target's (warped) probability of it clears ``min(threshold, alpha * exp(-H(p)))`` -- a
fixed bar where the target is sure (low entropy), a lower one where it is not -- and every draft before it was kept;
the target's own next token is then its argmax (Medusa-2's "greedy on the first token"). Drafts need no q, trees keep
their deepest typical node. It is NOT lossless: the output is not distributed as sampling from the target (it is
likelier and less varied), so it is never a default and headstart bench reports its quality cost next to its tau
(the mean target log-probability of the text, against plain sampling's).
"""

from __future__ import annotations

import torch


def typical(probs: torch.Tensor, tokens: torch.Tensor, threshold: float, alpha: float) -> torch.Tensor:
    """[...] True where ``tokens`` [...] is typical under ``probs`` [..., V] (Medusa's posterior_threshold and
    posterior_alpha: ``threshold`` and ``alpha``)."""
    p_x = probs.gather(-1, tokens[..., None]).squeeze(-1)
    entropy = torch.special.entr(probs.float()).sum(-1)  # -sum p log p, 0 log 0 = 0
    return p_x > torch.clamp(alpha * torch.exp(-entropy), max=threshold)


def verify_typical(draft_tokens: torch.Tensor, target_probs: torch.Tensor, threshold: float, alpha: float,
                   lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_tokens [B, k], target_probs [B, k+1, V] (warped), ``lengths`` [B] (padding is never kept): the longest
    typical prefix, then the target's argmax after it. Returns (accepted [B] in 0..k, next_token [B])."""
    k = draft_tokens.shape[1]
    ok = typical(target_probs[:, :k], draft_tokens, threshold, alpha)
    if lengths is not None:
        ok &= torch.arange(k, device=draft_tokens.device) < lengths[:, None]
    accepted = ok.long().cumprod(dim=1).sum(dim=1)
    return accepted, target_probs.argmax(-1).gather(1, accepted[:, None]).squeeze(1)
