"""Offline features: ``Features`` read from the feature store instead of computed by the target.

The batch is the same as online (rows of the tokenized dataset, right-padded or packed); each row's stored
tokens are checked against the batch's, so features from other data cannot slip in. Only what the
head's ``needs`` ask for is read. In bf16 storage the tensors equal the online ones exactly (same
bf16 values, same lm_head slice and arithmetic); fp8 states are dequantized; top-k storage gives the
target distribution on the draft vocab from the stored top-k probabilities (other entries get a
very low logit).
"""

from __future__ import annotations

import torch

from headstart.models.head import FeatureNeeds, Features
from headstart.models.target_matrices import TargetMatrices
from headstart.trainer.feature_store import FeatureStore, dequantize_fp8
from headstart.trainer.features import teacher_at_labels, vocab_mask

LOW_LOGIT = -1.0e4  # finite: softmax gives exactly 0 and 0 * log-softmax stays 0 (unlike -inf)


def _states(stored: dict[str, torch.Tensor], key: str, dtype: torch.dtype) -> torch.Tensor:
    """A stored [n, ...] state in ``dtype``: dequantized when it was stored in fp8 (a ``key_scale`` beside it)."""
    if f"{key}_scale" in stored:
        return dequantize_fp8(stored[key], stored[f"{key}_scale"], dtype)
    return stored[key].to(dtype)


class OfflineFeatures:
    def __init__(self, store: FeatureStore, matrices: TargetMatrices, needs: FeatureNeeds, draft_vocab_ids: torch.Tensor,
                 dtype: torch.dtype) -> None:
        store.storage.check_serves(needs, store.directory)
        self.store, self.matrices, self.needs, self.dtype = store, matrices, needs, dtype
        device = draft_vocab_ids.device
        self.t2d = vocab_mask(draft_vocab_ids, matrices.vocab_size)  # [V] bool
        self.to_draft = torch.full((self.t2d.numel(),), -1, dtype=torch.long, device=device)  # target id -> draft index
        self.to_draft[draft_vocab_ids] = torch.arange(draft_vocab_ids.numel(), device=device)
        self.num_draft = draft_vocab_ids.numel()
        self.draft_vocab_logits = matrices.vocab_head(draft_vocab_ids) if needs.draft_vocab_logits else None

    on_disk = True

    def problems(self, rows: list[int]) -> list[str]:
        """What keeps the stored features of these dataset rows from being read (corrupt or missing shards)."""
        return self.store.problems(rows)

    @torch.no_grad()
    def __call__(self, batch: dict[str, torch.Tensor]) -> Features:
        device = self.t2d.device
        input_ids = batch["input_ids"].to(device)
        B, T = input_ids.shape
        storage, n_aux, H = self.store.storage, self.store.manifest["num_aux_layers"], self.store.manifest["hidden_size"]
        needs = self.needs
        # The final hidden state is read when the head reads it, or when it is the source of the distribution.
        read_hidden = needs.last_hidden_state or (needs.draft_vocab_logits and storage.hidden is not None)
        aux = torch.zeros(B, T, n_aux * H, dtype=self.dtype, device=device) if needs.aux_hidden_states else None
        hidden = torch.zeros(B, T, H, dtype=self.dtype, device=device) if read_hidden else None
        use_topk = needs.draft_vocab_logits and hidden is None
        if use_topk:
            topk_ids = torch.zeros(B, T, storage.topk, dtype=torch.long, device=device)
            topk_probs = torch.zeros(B, T, storage.topk, dtype=torch.float32, device=device)
        for row, (b, start, length) in zip(batch["row"].tolist(), batch["segments"].tolist()):
            s = {k: v.to(device) for k, v in self.store.get(row).items()}
            n, at = s["input_ids"].numel(), slice(start, start + length)
            if n != length or not torch.equal(s["input_ids"].long(), input_ids[b, at]):
                raise ValueError(f"stored features of row {row} hold other tokens than this run's data row {row}: the "
                                 f"store {self.store.directory} was made from other data or data options")
            if aux is not None:
                aux[b, at] = _states(s, "aux", self.dtype).reshape(n, -1)
            if hidden is not None:
                hidden[b, at] = _states(s, "hidden", self.dtype)
            if use_topk:
                topk_ids[b, at], topk_probs[b, at] = s["topk_ids"].long(), s["topk_probs"].float()
        position_ids = batch["position_ids"].to(device) if "position_ids" in batch else None
        features = Features(input_ids=input_ids, loss_mask=batch["loss_mask"].to(device) * batch["attention_mask"].to(device),
                            aux_hidden_states=aux, last_hidden_state=hidden if needs.last_hidden_state else None,
                            position_ids=position_ids)
        if needs.draft_vocab_logits and not use_topk:
            features.target_logits, features.target_in_draft = teacher_at_labels(
                hidden, features.loss_mask, self.draft_vocab_logits, self.matrices.argmax, self.t2d)
        elif use_topk:
            # Top-k ids outside the draft vocab go to a spare last column, dropped after the scatter.
            target_logits = torch.full((B, T, self.num_draft + 1), LOW_LOGIT, device=device)
            slot = self.to_draft[topk_ids]  # [B, T, k] draft index or -1
            slot = torch.where(slot >= 0, slot, self.num_draft)
            target_logits.scatter_(2, slot, topk_probs.clamp(min=1e-30).log())
            features.target_logits = target_logits[..., : self.num_draft]
            features.target_in_draft = self.t2d[topk_ids[..., 0]]  # the stored top-1 is the full-vocab argmax
        return features
