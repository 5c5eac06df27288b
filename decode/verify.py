"""Chain verification: which of k drafted tokens the target accepts, and the token it emits next.

Under sampling a chain is verified token by token (``verify_sampling``), as a block (``verify_block``) or, not
losslessly, by typical acceptance (decode/typical.py); ``Verification`` is the rule a run chose. Every rule is
vectorised over the batch (block verification's carried weight is a loop of k small ops over it) with no host sync.
Greedy reproduces the target's greedy decoding exactly; rejection sampling (Leviathan
et al. 2023; Chen et al. 2023) reproduces the target's sampling distribution exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from headstart.decode.typical import verify_typical


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


def block_acceptance(
    draft_tokens: torch.Tensor,  # [B, k]
    draft_probs: torch.Tensor,  # [B, k, V] q
    target_probs: torch.Tensor,  # [B, k+1, V] p
    lengths: torch.Tensor | None = None,  # [B] row b's real drafts
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block verification's quantities (Sun et al., "Block Verification Accelerates Speculative Decoding", Algorithm 2).

    Returns (weight [B, k+1], h [B, k], residual [B, k+1, V]):
    - weight_i = min(weight_{i-1} p_i(x_i) / q_i(x_i), 1), weight_0 = 1: the block's acceptance probability carried
      along the drafts (where token verification restarts at every position);
    - residual_i = max(weight_i p_{i+1}(.) - q_{i+1}(.), 0), unnormalised: what the target's next token is drawn from
      when exactly the first i drafts are kept (q after the last real draft is 0, so the last residual is the target's
      own next distribution scaled by its weight);
    - h_i = |residual_i| / (|residual_i| + 1 - weight_i): the probability of keeping the first i drafts, decided from
      the end of the block (the longest i whose uniform falls under h_i wins). h is 0 past a row's real drafts.
    """
    B, k = draft_tokens.shape
    proposed = _proposed(draft_tokens, lengths)
    p_x = target_probs[:, :k].gather(2, draft_tokens[..., None]).squeeze(-1).float()  # [B, k]
    q_x = draft_probs.gather(2, draft_tokens[..., None]).squeeze(-1).float()
    ratio = torch.where(q_x > 0, p_x / q_x.clamp(min=1e-30), torch.zeros_like(p_x))  # a draft q never proposes: 0
    weights = [torch.ones(B, device=draft_tokens.device)]
    for i in range(k):  # k is a chain's length (<= 8 or so): a short loop of [B] ops, no host sync
        weights.append(torch.minimum(weights[-1] * ratio[:, i], torch.ones_like(weights[-1])))
    weight = torch.stack(weights, dim=1)  # [B, k+1]
    # q at position i: the distribution draft i+1 was drawn from; none after a row's last real draft.
    q_next = torch.cat([draft_probs.float(), draft_probs.new_zeros(B, 1, draft_probs.shape[-1], dtype=torch.float)], 1)
    has_next = torch.cat([proposed, proposed.new_zeros(B, 1)], dim=1)  # [B, k+1]
    q_next = q_next * has_next[..., None]
    residual = (weight[..., None] * target_probs.float() - q_next).clamp(min=0)  # [B, k+1, V]
    mass = residual.sum(-1)[:, 1:]  # [B, k]
    denominator = mass + 1 - weight[:, 1:]
    # 0/0 (weight 1 and p == q): keeping the drafts and drawing from p is exact; any h would be.
    h = torch.where(denominator > 0, mass / denominator.clamp(min=1e-30), torch.ones_like(mass))
    return weight, torch.where(proposed, h, torch.zeros_like(h)), residual


def verify_block(
    draft_tokens: torch.Tensor,  # [B, k]
    draft_probs: torch.Tensor,  # [B, k, V] q
    target_probs: torch.Tensor,  # [B, k+1, V] p
    generator: torch.Generator | None = None,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification (Sun et al., 2024/25; vLLM's ``rejection_sample_method="block"``): the drafts are accepted
    jointly, one uniform per position, the kept length the longest i whose uniform falls under ``h_i``
    (``block_acceptance``), then the next token drawn from that position's residual. Lossless like token verification
    and never fewer tokens kept in expectation, for the same p and q. Returns (accepted [B] in 0..k, next_token [B])."""
    B, k = draft_tokens.shape
    _, h, residual = block_acceptance(draft_tokens, draft_probs, target_probs, lengths)
    u = torch.rand(B, k, generator=generator, device=draft_tokens.device)
    positions = torch.arange(1, k + 1, device=draft_tokens.device)
    kept = torch.where(u < h, positions, torch.zeros_like(positions))
    accepted = torch.cat([kept.new_zeros(B, 1), kept], dim=1).amax(dim=1)  # [B]: the longest kept (0 if none; k may be 0)
    idx = accepted[:, None, None].expand(B, 1, residual.shape[-1])
    chosen = residual.gather(1, idx).squeeze(1)  # [B, V]
    mass = chosen.sum(-1, keepdim=True)
    chosen = torch.where(mass > 0, chosen / mass.clamp(min=1e-30), target_probs.gather(1, idx).squeeze(1).float())
    return accepted, torch.multinomial(chosen, 1, generator=generator).squeeze(1)


RULES = ("token", "block", "typical")
"""How sampled drafts are verified: token by token (Leviathan et al.; Chen et al.), jointly as a block (Sun et al.),
both lossless; or by Medusa-2's typical acceptance (decode/typical.py), which is not. Greedy decoding has one rule
(``verify_greedy``)."""


@dataclass(frozen=True)
class Verification:
    """The rule a run verifies its sampled drafts by (``RULES``), with typical acceptance's two parameters (Medusa's
    defaults: posterior_threshold 0.09, posterior_alpha 0.3)."""

    rule: str = "token"
    threshold: float = 0.09
    alpha: float = 0.3

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"unknown verification {self.rule!r}; the rules are {list(RULES)}")
        if not (0 < self.threshold <= 1 and self.alpha > 0):
            raise ValueError(f"typical acceptance needs 0 < threshold <= 1 and alpha > 0, got {self.threshold}, {self.alpha}")

    @property
    def lossless(self) -> bool:
        return self.rule != "typical"

    def check(self, tree: bool) -> None:
        """Block verification verifies chains: a tree's children are tried one after another at each node."""
        if tree and self.rule == "block":
            raise ValueError("block verification verifies a chain; a tree is verified node by node")

    def chain(self, draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
              generator: torch.Generator | None = None, lengths: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """A sampled chain's (accepted [B], next_token [B]) by this rule (``draft_probs`` unread by typical)."""
        if self.rule == "token":
            return verify_sampling(draft_tokens, draft_probs, target_probs, generator, lengths)
        if self.rule == "block":
            return verify_block(draft_tokens, draft_probs, target_probs, generator, lengths)
        return verify_typical(draft_tokens, target_probs, self.threshold, self.alpha, lengths)

    def describe(self) -> str:
        """As a run's mode says it ("" for token verification, the default)."""
        if self.rule == "typical":
            return f"typical acceptance (threshold {self.threshold:g}, alpha {self.alpha:g}; not lossless)"
        return "" if self.rule == "token" else f"{self.rule} verification"


TOKEN = Verification()


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters; the target's distribution is warped by them, and speculation preserves it."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return warp_probs(logits, self.temperature, self.top_k, self.top_p)
