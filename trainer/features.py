"""Online features: the frozen target runs in the training process and yields ``Features``.

Only what the head's ``needs`` ask for leaves the target: the aux hidden states, the final hidden
state, and/or its logits restricted to the head's vocab ([B, T, V_d] in the target's dtype) plus
whether its full-vocab argmax lies in that vocab (computed in position chunks, so [B, T, V] is
never materialised at once).
"""

from __future__ import annotations

import torch

from headstart.models.head import FeatureNeeds, Features
from headstart.models.target import Target, TargetOutput


def vocab_mask(vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] bool, true at ``vocab_ids`` (EAGLE-3's t2d)."""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=vocab_ids.device)
    mask[vocab_ids] = True
    return mask


class OnlineFeatures:
    def __init__(self, target: Target, needs: FeatureNeeds, draft_vocab_ids: torch.Tensor) -> None:
        self.target, self.needs = target, needs
        self.t2d = vocab_mask(draft_vocab_ids, target.vocab_size)  # [V] bool
        self.draft_vocab_logits = target.vocab_head(draft_vocab_ids) if needs.draft_vocab_logits else None

    on_disk = False  # nothing stored to go wrong: the trainer skips the per-step check

    def problems(self, rows: list[int]) -> list[str]:
        return []

    @torch.no_grad()
    def __call__(self, batch: dict[str, torch.Tensor]) -> Features:
        device = self.t2d.device
        input_ids = batch["input_ids"].to(device)
        attention_mask = batch["attention_mask"].to(device)
        position_ids = batch["position_ids"].to(device) if "position_ids" in batch else None
        # A packed batch (trainer/batches.py) gives the target its position_ids and no 2D mask: transformers then
        # finds the sequences where the positions restart and keeps each one's attention to itself.
        out = self.target(input_ids, attention_mask=attention_mask if position_ids is None else None,
                          position_ids=position_ids, with_aux=self.needs.aux_hidden_states)
        return self.from_states(input_ids, batch["loss_mask"].to(device) * attention_mask, out, position_ids)

    @torch.no_grad()
    def from_states(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, states: TargetOutput,
                    position_ids: torch.Tensor | None = None) -> Features:
        """The head's features from the target's states over ``input_ids`` (this class's own forward, or a decoder's
        verify passes: trainer/online.py): what ``needs`` asks for, the teacher's logits at the trained positions."""
        features = Features(input_ids=input_ids, loss_mask=loss_mask, position_ids=position_ids,
                            aux_hidden_states=states.aux_hidden_states if self.needs.aux_hidden_states else None)
        if self.needs.last_hidden_state:
            features.last_hidden_state = states.last_hidden_state
        if self.needs.draft_vocab_logits:
            features.target_logits, features.target_in_draft = teacher_at_labels(
                states.last_hidden_state, loss_mask, self.draft_vocab_logits, self.target.argmax, self.t2d)
        return features


def teacher_at_labels(hidden: torch.Tensor, loss_mask: torch.Tensor, vocab_logits, argmax, t2d: torch.Tensor):
    """The target's logits on the draft vocab [B, T, V_d] and whether its full-vocab argmax lies in it [B, T],
    computed only at the positions whose next token is trained (``loss_mask[:, t+1]``): no loss reads them anywhere
    else (a head's step k reads position t+1+k only where token t+2+k is trained), and on chat data that skips the
    vocab projections of the prompts. Zeros (and False) elsewhere. Online and offline features share it, so both
    compute the same bits."""
    B, T, _ = hidden.shape
    labelled = torch.zeros(B, T, dtype=torch.bool, device=hidden.device)
    labelled[:, :-1] = loss_mask[:, 1:].bool()
    b, t = labelled.nonzero(as_tuple=True)
    rows = hidden[b, t]  # [N, H]
    logits = vocab_logits(rows)  # [N, V_d]
    target_logits = logits.new_zeros(B, T, logits.shape[-1])
    target_logits[b, t] = logits
    in_draft = torch.zeros(B, T, dtype=torch.bool, device=hidden.device)
    in_draft[b, t] = t2d[argmax(rows)]
    return target_logits, in_draft
