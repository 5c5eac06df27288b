"""EAGLE-3 drafting at inference, consistent with its training-time test: one drafter for one sequence or a batch.

Draft position j pairs the target's aux feature f_j with token x_{j+1}, and its output predicts
x_{j+2}. Committed pairs live in the draft's own KV cache (a layer each). To propose k tokens from
the last committed position t, step i (i >= 1) feeds back the previous step's hidden output with
the token just drafted, at rotary position t + i, attending to the committed keys plus the keys of
its own earlier steps -- the same attention pattern and positions as TTT step i.

Both paths -- one sequence (chains, EAGLE-2 trees, compiled graphs) and a batch of ragged rows -- are the layer
drafter's (decode/layer_drafter.py), which runs the head's one step (``Eagle3Draft.step``, training's) over its cache;
this drafter supplies the step's attention on that cache, ``fc`` over the aux states and the draft vocab's map. The
one-sequence decoding is what ``benchmarks/versus_revision.py`` holds against earlier revisions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from headstart.decode.drafter import Capabilities
from headstart.decode.layer_drafter import LayerDrafter
from headstart.heads.eagle3.module import Eagle3Draft
from headstart.models.target import TargetOutput


class Eagle3Drafter(LayerDrafter):
    # Trees of its own ranked candidates (and the full-depth one as one compiled graph); its own batch rows.
    capabilities = Capabilities(trees=("dynamic", "static"), batches=True, sampled=True, compiled=True, compiled_batch=True,
                                confidence=True, reads_aux=True)

    def __init__(self, head: Eagle3Draft, max_len: int, compile: bool = False, backend: str = "inductor") -> None:
        """``compile``: the draft step compiled at static shapes (decode/layer_drafter.py); build one drafter and reuse
        it for every prompt or batch (``begin``/``begin_batch`` start afresh), so it compiles once."""
        self.head = head.eval()
        c = head.config
        self.hidden_size, self.input_width, self.dtype = c.hidden_size, head.fc.in_features, head.fc.weight.dtype
        self.target_vocab_size, self.num_layers = c.vocab_size, c.num_hidden_layers
        super().__init__(max_len, head.fc.weight.device, compile, backend)

    def layer(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
              cache) -> torch.Tensor:
        """Training's step, each layer's attention reading that layer's cache (``Eagle3Draft.step``'s ``attend``)."""
        mask = allowed if allowed.dim() == 2 else allowed.unsqueeze(1)  # a batch's [B, n, S]: one mask for all heads

        def cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
            keys, values = cache.layers[layer].update(k, v)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)

        return self.head.step(hidden, tokens, positions, cached)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.draft_logits(hidden)

    def commit_input(self, states: TargetOutput) -> torch.Tensor:
        return states.aux_hidden_states.to(self.dtype)

    def project(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head.project(inputs)

    @property
    def last_logits(self) -> torch.Tensor | None:
        """[1, V_d]: the draft logits after the last committed pair as one row, this drafter's layout since its first
        version (``next_logits``, [V_d], is what the shared code reads)."""
        return None if self.next_logits is None else self.next_logits.unsqueeze(0)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.head.d2t[draft_ids]

    def draft_vocab(self) -> torch.Tensor:
        return self.head.target_vocab_ids()
