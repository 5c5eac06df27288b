"""MTP drafting at inference, consistent with its unrolled training.

Draft pair j is (the target's final hidden state at j, token x_{j+1}) at rotary position j, as vLLM numbers it;
committed pairs live in the layer's own KV cache (one layer), and step i feeds back the layer's previous output with
the token just drafted -- the one-layer drafter's loop (decode/layer_drafter.py, which EAGLE-3's drafter shares), one
sequence or a batch. This drafter supplies the layer: ``eh_proj`` over the embedding and the hidden state, then the
decoder block over the cache, and the target's lm_head.
"""

from __future__ import annotations

import torch

from headstart.decode.drafter import Capabilities, Drafter
from headstart.decode.layer_drafter import LayerDrafter
from headstart.heads.mtp.module import MTPHead
from headstart.models.target import TargetOutput, additive_mask


class MTPDrafter(LayerDrafter):
    # Greedy drafts only (q one-hot); reads the final hidden state, no aux states.
    capabilities = Capabilities(trees=("dynamic", "static"), batches=True, compiled=True, compiled_batch=True, confidence=True)
    # No sampled q declared: the loop verifies its chains, one sequence or a batch, as one-hot (Drafter's rule).
    propose_sampled = Drafter.propose_sampled
    propose_sampled_batch = Drafter.propose_sampled_batch

    def __init__(self, head: MTPHead, max_len: int, compile: bool = False, backend: str = "inductor") -> None:
        """``compile``: the layer's step compiled over a static cache (decode/layer_drafter.py); reuse one drafter for
        every prompt (``begin`` starts afresh), so it compiles once."""
        self.head = head.eval()
        self.hidden_size = self.input_width = head.eh_proj.out_features
        self.dtype, self.target_vocab_size = head.eh_proj.weight.dtype, head.config.vocab_size
        super().__init__(max_len, head.eh_proj.weight.device, compile, backend)

    def layer(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
              cache) -> torch.Tensor:
        """The MTP layer on pairs: ``eh_proj`` over the token's embedding and the hidden state, then the block."""
        x = self.head.fuse(tokens, hidden, positions)
        return self.head.layer(x, positions, additive_mask(allowed, x.dtype), cache)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.logits(hidden).float()

    def commit_input(self, states: TargetOutput) -> torch.Tensor:
        return states.last_hidden_state
