"""Online features: the frozen target runs in the training process and yields ``Features``.

Only what a head needs leaves the target: the aux hidden states and its logits restricted to the
draft vocab ([B, T, V_d] in the target's dtype), plus whether its full-vocab argmax lies in the
draft vocab (computed in position chunks, so [B, T, V] is never materialised at once).
"""

from __future__ import annotations

import torch

from headstart.models.head import Features
from headstart.models.target import Target


class OnlineFeatures:
    def __init__(self, target: Target, draft_vocab_ids: torch.Tensor, t2d: torch.Tensor) -> None:
        self.target = target
        self.draft_vocab_ids = draft_vocab_ids  # [V_d] target ids
        self.t2d = t2d  # [V] bool
        self.draft_vocab_logits = target.vocab_head(draft_vocab_ids)

    @torch.no_grad()
    def __call__(self, batch: dict[str, torch.Tensor]) -> Features:
        device = self.draft_vocab_ids.device
        input_ids = batch["input_ids"].to(device)
        attention_mask = batch["attention_mask"].to(device)
        out = self.target(input_ids, attention_mask=attention_mask)
        return Features(
            input_ids=input_ids,
            loss_mask=batch["loss_mask"].to(device) * attention_mask,
            aux_hidden_states=out.aux_hidden_states,
            target_logits=self.draft_vocab_logits(out.last_hidden_state),
            target_in_draft=self.t2d[self.target.argmax(out.last_hidden_state, chunk_tokens=1024)],
        )
