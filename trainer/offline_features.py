"""Offline features: ``Features`` read from the feature store instead of computed by the target.

The batch is the same as online (rows of the tokenized dataset, right-padded); each row's stored
tokens are checked against the batch's, so features from other data cannot slip in. In bf16 /
``hidden`` storage the tensors equal the online ones exactly (same bf16 values, same lm_head slice
and arithmetic); fp8 aux states are dequantized; top-k storage gives the target distribution on
the draft vocab from the stored top-k probabilities (other entries get a very low logit).
"""

from __future__ import annotations

import torch

from headstart.models.head import Features
from headstart.models.target_matrices import TargetMatrices
from headstart.trainer.feature_store import FeatureStore, dequantize_fp8

LOW_LOGIT = -1.0e4  # finite: softmax gives exactly 0 and 0 * log-softmax stays 0 (unlike -inf)


class OfflineFeatures:
    def __init__(self, store: FeatureStore, matrices: TargetMatrices, draft_vocab_ids: torch.Tensor, t2d: torch.Tensor,
                 dtype: torch.dtype) -> None:
        self.store, self.matrices, self.dtype = store, matrices, dtype
        self.t2d = t2d  # [V] bool
        device = draft_vocab_ids.device
        self.to_draft = torch.full((t2d.numel(),), -1, dtype=torch.long, device=device)  # target id -> draft index
        self.to_draft[draft_vocab_ids] = torch.arange(draft_vocab_ids.numel(), device=device)
        self.num_draft = draft_vocab_ids.numel()
        self.draft_vocab_logits = matrices.vocab_head(draft_vocab_ids)

    @torch.no_grad()
    def __call__(self, batch: dict[str, torch.Tensor]) -> Features:
        device = self.t2d.device
        input_ids = batch["input_ids"].to(device)
        B, T = input_ids.shape
        storage, n_aux, H = self.store.storage, self.store.manifest["num_aux_layers"], self.store.manifest["hidden_size"]
        aux = torch.zeros(B, T, n_aux * H, dtype=self.dtype, device=device)
        hidden = torch.zeros(B, T, H, dtype=self.dtype, device=device) if storage.target_dist == "hidden" else None
        topk_ids = torch.zeros(B, T, storage.topk, dtype=torch.long, device=device)
        topk_probs = torch.zeros(B, T, storage.topk, dtype=torch.float32, device=device)
        for b, row in enumerate(batch["row"].tolist()):
            s = {k: v.to(device) for k, v in self.store.get(row).items()}
            n = s["input_ids"].numel()
            if n != int(batch["attention_mask"][b].sum()) or not torch.equal(s["input_ids"].long(), input_ids[b, :n]):
                raise ValueError(f"stored features of row {row} hold other tokens than this run's data row {row}: the "
                                 f"store {self.store.directory} was made from other data or data options")
            a = dequantize_fp8(s["aux"], s["aux_scale"], self.dtype) if storage.aux == "fp8" else s["aux"].to(self.dtype)
            aux[b, :n] = a.reshape(n, -1)
            if hidden is not None:
                hidden[b, :n] = s["hidden"].to(self.dtype)
            else:
                topk_ids[b, :n], topk_probs[b, :n] = s["topk_ids"].long(), s["topk_probs"].float()
        if hidden is not None:
            target_logits = self.draft_vocab_logits(hidden)
            target_in_draft = self.t2d[self.matrices.argmax(hidden, chunk_tokens=1024)]
        else:
            # Top-k ids outside the draft vocab go to a spare last column, dropped after the scatter.
            target_logits = torch.full((B, T, self.num_draft + 1), LOW_LOGIT, device=device)
            slot = self.to_draft[topk_ids]  # [B, T, k] draft index or -1
            slot = torch.where(slot >= 0, slot, self.num_draft)
            target_logits.scatter_(2, slot, topk_probs.clamp(min=1e-30).log())
            target_logits = target_logits[..., : self.num_draft]
            target_in_draft = self.t2d[topk_ids[..., 0]]  # the stored top-1 is the full-vocab argmax
        return Features(
            input_ids=input_ids,
            loss_mask=batch["loss_mask"].to(device) * batch["attention_mask"].to(device),
            aux_hidden_states=aux,
            target_logits=target_logits,
            target_in_draft=target_in_draft,
        )
