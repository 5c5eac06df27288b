"""P-EAGLE draft head (arXiv 2602.01469): EAGLE-3's network that drafts all k tokens of a round in one forward.

The round's forward holds the newly committed pairs (f_j, x_{j+1}) and, after the last of them (position t), k-1
placeholder pairs: the token ``mask_token_id`` and the learned aux feature ``mask_hidden`` [1, 1, n * H_t] (through
``fc_norm``/``fc`` like a real feature), at rotary positions t+1..t+k-1. Attention is the draft's causal one, so
placeholder d sees the context up to t and placeholders < d; the output at t predicts x_{t+2} and placeholder d
predicts x_{t+2+d}. This is vLLM's parallel drafting (an EAGLE-3 model with ``parallel_drafting``; docs/FORMATS.md B.1).

Training is EAGLE-3's training-time test with other inputs: depth 0 is the real pair at every position, depth d >= 1
the placeholder pair at rotary position t + d, attending to depth 0's keys up to t and to its own position's depths
1..d -- exactly the TTT attention pattern (models/ttt_attention.py), so ``Eagle3Draft.unroll_hidden`` and its loss
run unchanged, ``step_input`` supplying the placeholders. Depth d's target is the target's distribution for token
t+2+d, as TTT step d's. Unlike EAGLE-3 no depth reads another's output: the k drafts of a round are independent
given the context, which is why one forward proposes them all.
"""

from __future__ import annotations

import torch
from torch import nn

from headstart.heads.eagle3.module import Eagle3Draft, fit_to_target
from headstart.heads.peagle.config import PEagleConfig, PEagleOptions
from headstart.models.head import DraftConfig


class PEagleDraft(Eagle3Draft):
    """EAGLE-3's head plus the placeholder feature ``mask_hidden``; ``ttt_steps`` is its K depths."""

    config_class = PEagleConfig

    def __init__(self, config: PEagleConfig, ttt_steps: int = 8, step_weight: float = 1.0) -> None:
        super().__init__(config, ttt_steps=ttt_steps, step_weight=step_weight)
        # In the aux features' space, before fc_norm/fc: vLLM computes the placeholder's hidden as
        # combine_hidden_states(mask_hidden) once at load (speculators' and SpecForge's init: randn).
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, len(config.aux_layer_ids) * config.target_hidden_size))

    def placeholder(self) -> torch.Tensor:
        """The placeholder pair's hidden input [1, 1, H]: ``mask_hidden`` projected as a real feature is."""
        return self.project(self.mask_hidden.to(self.fc.weight.dtype))

    def step_input(self, k: int, hidden: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Depth k >= 1 reads the placeholder pair, not the previous depth's output or the data's token."""
        if k == 0:
            return hidden, tokens
        return self.placeholder().expand_as(hidden), torch.full_like(tokens, self.config.mask_token_id)


def build_peagle(draft: DraftConfig, target, token_counts: torch.Tensor) -> PEagleDraft:
    """A fresh P-EAGLE head for ``target`` (a Target): its draft vocab from the loss-masked token counts [V]."""
    options = draft.options or PEagleOptions()
    if options.parallel_tokens < 1:
        raise ValueError(f"draft.parallel_tokens must be >= 1, got {options.parallel_tokens}")
    if draft.config:
        config = PEagleConfig.from_json(draft.config)
        if config.fc_norm != options.fc_norm and options.fc_norm:
            raise ValueError(f"draft.fc_norm is true but draft.config ({draft.config}) sets it false: set it in the "
                             "config file, or drop draft.config")
    else:
        config = PEagleConfig.from_target(target.config, options.draft_vocab_size, target.aux_layer_ids,
                                          fc_norm=options.fc_norm, mask_token_id=options.mask_token_id,
                                          parallel_tokens=options.parallel_tokens)
    head = PEagleDraft(config, ttt_steps=options.parallel_tokens, step_weight=options.step_weight)
    return fit_to_target(head, draft, target, token_counts, options.feature_noise)
