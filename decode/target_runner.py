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
        self.target = target
        self.max_len = max_len
        self.with_aux = with_aux
        self.cache = PositionalKVCache(target.num_layers, max_len)
        self._dtype = next(target.model.parameters()).dtype
        # Sliding-window attention (Gemma 2/3, Mistral, Qwen with use_sliding_window): those layers see only
        # keys less than ``window`` positions back. The mask is explicit here, so the window must be in it.
        config = target.config.get_text_config()
        self.window = getattr(config, "sliding_window", None)
        types = getattr(config, "layer_types", None)
        if types is None:  # no per-layer types: a window, when set, applies to every layer (Mistral)
            types = ["sliding_attention" if self.window else "full_attention"] * target.num_layers
        self.layer_types = set(types) if self.window else {"full_attention"}

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
        offsets = torch.arange(n, device=device) if depths is None else depths
        position_ids = (start + offsets).unsqueeze(0)
        mask = self._mask(allowed, position_ids[0], start)
        self.cache.begin()
        out = self.target(input_ids, attention_mask=mask, position_ids=position_ids, past_key_values=self.cache,
                          with_aux=self.with_aux)
        return self.target.logits(out.last_hidden_state), out

    def _mask(self, allowed: torch.Tensor, query_pos: torch.Tensor, start: int):
        """The additive mask for every layer, or a {layer type: mask} dict (what HF models with
        ``layer_types`` take) when sliding and full attention layers are mixed. A committed key sits at its
        own position; a key of this block at its query's (tree depth) position."""
        full = additive_mask(allowed, self._dtype)
        if "sliding_attention" not in self.layer_types:
            return full
        key_pos = torch.cat([torch.arange(start, device=allowed.device), query_pos])  # [start + n]
        in_window = (query_pos[:, None] - key_pos[None, :]) < self.window  # HF: kv_idx > q_idx - window
        sliding = additive_mask(allowed & in_window, self._dtype)
        if self.layer_types == {"sliding_attention"}:
            return sliding
        return {"full_attention": full, "sliding_attention": sliding}
