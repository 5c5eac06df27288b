"""The quality of sampled text as the target sees it: the mean log-probability of each token under the warped target.

Lossless speculative sampling leaves it where plain sampling puts it (up to sampling noise); a rule that is not lossless
(typical acceptance, decode/typical.py) moves it -- up where it prefers the target's likelier tokens (less varied
text). ``headstart bench`` reports it for both, under sampling, from one untimed target forward per reply.
"""

from __future__ import annotations

import torch

from headstart.decode.verify import Sampling


@torch.no_grad()
def text_logprob(model, prompt: torch.Tensor, tokens: list[int], sampling: Sampling) -> tuple[float, int]:
    """(sum of log p(token | prompt, tokens before it) under ``sampling``'s warp of the target ``model``, count)."""
    if not tokens:
        return 0.0, 0
    ids = torch.cat([prompt, torch.tensor([tokens], device=prompt.device)], dim=1)
    logits = model(ids[:, :-1]).logits[0, prompt.shape[1] - 1 :]  # [len(tokens), V]: each token's distribution
    chosen = sampling.probs(logits).gather(1, ids[0, prompt.shape[1] :, None]).squeeze(1)
    return float(chosen.clamp(min=1e-30).log().sum()), len(tokens)
