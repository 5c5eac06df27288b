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

COD sampling (the paper's; speculators' ``generate_cod_sample_indices``) trains depth d at a random share
max(r^d, r_min) of the anchors, each depth's anchors among the depth before's (a depth-d query needs its anchor's
depths 1..d-1 as keys): one uniform draw per position, kept at depth d while under that depth's share. The unroll
then runs depth d only there, so K depths cost about 1 + r + r^2 + ... positions' worth instead of K.
"""

from __future__ import annotations

import torch
from torch import nn

from headstart.heads.eagle3.module import Eagle3Draft, check_layers, fit_to_target
from headstart.heads.peagle.config import PEagleConfig, PEagleOptions
from headstart.models.head import DraftConfig


class PEagleDraft(Eagle3Draft):
    """EAGLE-3's head plus the placeholder feature ``mask_hidden``; ``ttt_steps`` is its K depths."""

    config_class = PEagleConfig

    def __init__(self, config: PEagleConfig, ttt_steps: int = 8, step_weight: float = 1.0,
                 down_sample_ratio: float = 1.0, down_sample_ratio_min: float = 0.2) -> None:
        super().__init__(config, ttt_steps=ttt_steps, step_weight=step_weight)
        self.down_sample_ratio, self.down_sample_ratio_min = down_sample_ratio, down_sample_ratio_min
        # In the aux features' space, before fc_norm/fc: vLLM computes the placeholder's hidden as
        # combine_hidden_states(mask_hidden) once at load (speculators' and SpecForge's init: randn).
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, len(config.aux_layer_ids) * config.target_hidden_size))

    def placeholder(self) -> torch.Tensor:
        """The placeholder pair's hidden input [1, 1, H]: ``mask_hidden`` projected as a real feature is."""
        return self.project(self.mask_hidden.to(self.fc.weight.dtype))

    def depth_share(self, d: int) -> float:
        """The share of the positions depth d is trained at while training (COD; 1.0 without it)."""
        return 1.0 if d == 0 or self.down_sample_ratio >= 1.0 else max(self.down_sample_ratio**d,
                                                                         self.down_sample_ratio_min)

    def steps_run(self) -> float:
        return sum(self.depth_share(d) for d in range(self.ttt_steps))

    def trained_positions(self, valid_steps: list[torch.Tensor]) -> list[torch.Tensor]:
        """COD while training: depth d where it can be trained and the position's one uniform draw is under
        ``depth_share(d)`` -- the shares fall with d, so each depth's positions lie among the depth before's.
        Evaluation (eval mode, or no gradients: the trainer's held-out pass) scores every depth everywhere."""
        if not (self.training and torch.is_grad_enabled()) or self.down_sample_ratio >= 1.0:
            return valid_steps
        draw = torch.rand(valid_steps[0].shape, device=valid_steps[0].device)
        return [valid & (draw < self.depth_share(d)) for d, valid in enumerate(valid_steps)]

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
    if not 0 < options.down_sample_ratio <= 1 or not 0 < options.down_sample_ratio_min <= 1:
        raise ValueError(f"draft.down_sample_ratio ({options.down_sample_ratio}) and draft.down_sample_ratio_min "
                         f"({options.down_sample_ratio_min}) are shares of the positions: each must be in (0, 1]")
    if draft.config:
        config = PEagleConfig.from_json(draft.config)
        if config.fc_norm != options.fc_norm and options.fc_norm:
            raise ValueError(f"draft.fc_norm is true but draft.config ({draft.config}) sets it false: set it in the "
                             "config file, or drop draft.config")
        check_layers(options.num_layers, config, draft.config)
    else:
        config = PEagleConfig.from_target(target.config, options.draft_vocab_size, target.aux_layer_ids,
                                          fc_norm=options.fc_norm, mask_token_id=options.mask_token_id,
                                          parallel_tokens=options.parallel_tokens, num_layers=options.num_layers)
    head = PEagleDraft(config, ttt_steps=options.parallel_tokens, step_weight=options.step_weight,
                       down_sample_ratio=options.down_sample_ratio, down_sample_ratio_min=options.down_sample_ratio_min)
    return fit_to_target(head, draft, target, token_counts, options.feature_noise)
