"""Run the target over new tokens against a ``PositionalKVCache`` (batch size 1).

``forward`` scores a block of n new tokens placed after the committed cache: a chain (causal) or a
tree (``tree_mask[i, j]``: token i may attend to token j, its ancestors and itself; position ids by
depth). It returns full-vocab logits for the n positions only and the target's states there (aux
hidden states for EAGLE-3, the final hidden state for Medusa and MTP), which drafters read. The
block is written to the cache but not committed: the caller keeps what was accepted (``commit`` for
a chain prefix, ``cache.keep`` for a tree path) and the rest is simply overwritten.
"""

from __future__ import annotations

import torch

from headstart.decode.kv_cache import PositionalKVCache
from headstart.models.target import Target, TargetOutput, additive_mask


class TargetRunner:
    def __init__(self, target: Target, max_len: int, with_aux: bool = True) -> None:
        """``with_aux``: whether drafters read the aux hidden states (EAGLE-3); others skip building them."""
        window = getattr(target.config, "sliding_window", None)
        if window is not None and window < max_len and any(
            t == "sliding_attention" for t in getattr(target.config, "layer_types", None) or ["sliding_attention"]
        ):
            raise NotImplementedError(
                f"the target uses sliding-window attention ({window} tokens) and max_len {max_len} exceeds it; "
                "the decoder's explicit attention mask does not apply windows yet"
            )
        self.target = target
        self.max_len = max_len
        self.with_aux = with_aux
        self.cache = PositionalKVCache(target.num_layers, max_len)
        self._dtype = next(target.model.parameters()).dtype

    @property
    def length(self) -> int:
        return self.cache.length

    def reset(self) -> None:
        self.cache.rollback(0)

    def commit(self, n: int) -> None:
        """Keep the first n tokens of the last block (a chain's accepted prefix)."""
        self.cache.rollback(self.cache.length + n)

    def keep(self, path: list[int]) -> None:
        """Keep the tokens at block indices ``path`` (a tree's accepted path, root first)."""
        self.cache.keep(self.cache.length + torch.tensor(path, device=self.cache.device))

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [1, n]
        tree_mask: torch.Tensor | None = None,  # [n, n] bool, True = may attend
        depths: torch.Tensor | None = None,  # [n] position offset of each token (tree depth)
    ) -> tuple[torch.Tensor, TargetOutput]:
        """-> (logits [1, n, V], the target's states [1, n, ...]) for the n new tokens."""
        n = input_ids.shape[1]
        start = self.cache.length
        device = input_ids.device
        within = torch.ones(n, n, dtype=torch.bool, device=device).tril() if tree_mask is None else tree_mask
        allowed = torch.cat([torch.ones(n, start, dtype=torch.bool, device=device), within], dim=1)  # [n, start+n]
        mask = additive_mask(allowed, self._dtype)
        offsets = torch.arange(n, device=device) if depths is None else depths
        position_ids = (start + offsets).unsqueeze(0)
        self.cache.begin()
        out = self.target(input_ids, attention_mask=mask, position_ids=position_ids, past_key_values=self.cache,
                          with_aux=self.with_aux)
        return self.target.logits(out.last_hidden_state), out
