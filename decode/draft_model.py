"""Classic speculative decoding's drafter: an independent small causal LM with the target's tokenizer.

It keeps its own ``PositionalKVCache`` over every emitted token. Drafting runs it one level at a time
(a chain is a tree with one child per node); nodes are written after the committed slots and simply
overwritten later. After a chain round, the accepted drafts the model already ran sit in their own slots with
exactly the context a re-run would give them, so they are kept and only the rest of the emitted tokens (the
bonus token, and the last draft when every draft was accepted) are run; after a tree round the emitted tokens
are re-run as one block, which is cheaper than tracking which tree slots survived.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from headstart.decode.kv_cache import PositionalKVCache
from headstart.models.target import additive_mask
from headstart.decode.tree import ExpandedNodes


def fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The draft model's logits [..., V_draft] as wide as the target's (q must match p): a padded draft vocab loses
    the ids the target cannot emit (never drafted), a narrower one gets -inf for the ids it lacks."""
    width = logits.shape[-1]
    if width > vocab_size:
        return logits[..., :vocab_size]
    if width < vocab_size:
        return torch.nn.functional.pad(logits, (0, vocab_size - width), value=float("-inf"))
    return logits


class DraftModelDrafter:
    def __init__(self, model: PreTrainedModel, max_len: int, target_vocab_size: int) -> None:
        self.model = model.eval()
        self.max_len = max_len
        self.vocab_size = target_vocab_size  # the width of the target's logits (q must match it)
        config = model.config.get_text_config()
        self.cache = PositionalKVCache(config.num_hidden_layers, max_len)
        self._dtype = next(model.parameters()).dtype
        self._device = next(model.parameters()).device
        self.last_logits: torch.Tensor | None = None  # [V]: the next token after the committed ones
        self.chain_fed = 0  # drafts of the last chain run through the model, in slots committed.. (0 after a tree)

    def _run(self, ids: torch.Tensor, start: int, allowed: torch.Tensor, positions: torch.Tensor, last_only: bool = False):
        """Score ids [m] written at slots [start, start+m) under ``allowed`` [m, start+m]; logits [m or 1, V]."""
        if start + ids.numel() > self.max_len:
            raise ValueError(f"draft model KV cache overflow: {start + ids.numel()} > max_len {self.max_len}")
        self.cache.begin(start)
        out = self.model(input_ids=ids.view(1, -1), attention_mask=additive_mask(allowed, self._dtype),
                         position_ids=positions.view(1, -1), past_key_values=self.cache, use_cache=True,
                         logits_to_keep=1 if last_only else 0)
        return fit_vocab(out.logits[0].float(), self.vocab_size)

    @torch.no_grad()
    def _advance(self, ids: torch.Tensor) -> None:
        start, m = self.cache.length, ids.numel()
        allowed = torch.ones(m, start + m, dtype=torch.bool, device=self._device)
        allowed[:, start:] = torch.ones(m, m, dtype=torch.bool, device=self._device).tril()
        self.last_logits = self._run(ids.to(self._device), start, allowed,
                                     torch.arange(start, start + m, device=self._device), last_only=True)[-1]
        self.cache.rollback(start + m)

    def begin(self, prompt_ids: torch.Tensor, states, next_token: int) -> None:
        self.cache.rollback(0)
        self._advance(torch.cat([prompt_ids[0].to(self._device), torch.tensor([next_token], device=self._device)]))

    def update(self, emitted: list[int], states) -> None:
        keep = min(len(emitted) - 1, self.chain_fed)  # accepted drafts whose KV the chain already wrote in place
        self.cache.rollback(self.cache.length + keep)
        self.chain_fed = 0
        self._advance(torch.tensor(emitted[keep:], device=self._device))

    # -- trees (decode/tree.py) ------------------------------------------------------------------
    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    def tree_root(self) -> torch.Tensor:
        self._expanded = ExpandedNodes(self._device)
        self.chain_fed = 0
        return self.last_logits

    @torch.no_grad()
    def tree_expand(self, parents: torch.Tensor, tokens: torch.Tensor, depth: int) -> torch.Tensor:
        """Feed m nodes at ``depth`` (position length-1+depth), each seeing the committed tokens, its
        expanded ancestors and itself; returns their children's logits [m, V]."""
        m, done, committed = tokens.numel(), self._expanded.count, self.cache.length
        new_anc = self._expanded.add(parents)  # [m, done+m]
        allowed = torch.cat([torch.ones(m, committed, dtype=torch.bool, device=self._device), new_anc], dim=1)
        positions = torch.full((m,), committed - 1 + depth, device=self._device)
        return self._run(tokens, committed + done, allowed, positions)

    # -- chains ----------------------------------------------------------------------------------
    def _chain(self, k: int, pick) -> torch.Tensor:
        logits, tokens = self.tree_root(), []
        for i in range(k):
            tokens.append(pick(logits).view(1))
            if i + 1 < k:
                logits = self.tree_expand(torch.tensor([i - 1], device=self._device), tokens[-1], i + 1)[0]
        self.chain_fed = max(0, k - 1)  # d_1..d_{k-1} ran, at slots committed.. in order
        return torch.cat(tokens) if tokens else torch.empty(0, dtype=torch.long, device=self._device)

    @torch.no_grad()
    def propose(self, k: int) -> torch.Tensor:
        return self._chain(k, lambda logits: logits.argmax(-1))

    @torch.no_grad()
    def propose_sampled(self, k: int, sampling, generator: torch.Generator | None = None):
        """Drafts sampled from the warped draft distribution, with those distributions q [k, V]."""
        q_steps: list[torch.Tensor] = []

        def pick(logits: torch.Tensor) -> torch.Tensor:
            q_steps.append(sampling.probs(logits))
            return torch.multinomial(q_steps[-1], 1, generator=generator)

        tokens = self._chain(k, pick)
        q = torch.stack(q_steps) if q_steps else torch.zeros(0, self.vocab_size, device=self._device)
        return tokens, q
