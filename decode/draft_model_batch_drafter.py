"""The draft model drafting a batch of sequences of different lengths: one forward of the small model per draft step
for every row, instead of one per row (``PerSequence`` over decode/draft_model.py).

The small model runs on its own ``RaggedRunner`` (the same ragged KV cache and masks as the batch's target): each
row's committed tokens are its own, and chain step i writes at each row's committed length + i, attending to the
row's earlier steps. As the one-sequence drafter does, the accepted drafts a chain already ran are kept in place
(their slots hold exactly what a re-run would write), so only the rest of each row's emitted tokens is run.
"""

from __future__ import annotations

import torch

from headstart.decode.batch_generate import padded_rows
from headstart.decode.draft_model import as_draft_target, fit_vocab  # noqa: F401 (as_draft_target: re-exported)
from headstart.decode.drafter import Capabilities
from headstart.decode.generate import Sampling
from headstart.decode.target_runner import RaggedRunner
from headstart.models.target import Target, TargetOutput


class DraftModelBatchDrafter:
    capabilities = Capabilities(batches=True, sampled=True)  # eager: the draft model's graphs are one sequence's

    def __init__(self, draft: Target, max_len: int, target_vocab_size: int, batch: int) -> None:
        """``draft``: the small model wrapped once as a ``Target`` (``as_draft_target``), shared by every batch."""
        self.runner = RaggedRunner(draft, max_len, with_aux=False)
        self.runner.reset(batch)
        self.vocab_size = target_vocab_size
        self.device = draft.lm_head.weight.device
        self.last_logits: torch.Tensor | None = None  # [B, V]: each row's next token after its committed ones
        self.chain_fed = 0  # drafts of the last chain run through the model, at each row's slots committed..

    def _commit(self, rows: list[list[int]]) -> None:
        """Run and commit row b's tokens rows[b] (at least one each); keep the logits after each row's last."""
        tokens, counts = padded_rows(rows, self.device)
        logits, _ = self.runner.forward(tokens, valid=counts, last_only=True)
        self.runner.commit(counts)
        self.last_logits = fit_vocab(logits.float(), self.vocab_size)

    def begin_batch(self, prompts: list[torch.Tensor], states: TargetOutput, next_tokens: list[int]) -> None:
        self.runner.reset(len(prompts))
        self.chain_fed = 0
        self._commit([p[0].tolist() + [t] for p, t in zip(prompts, next_tokens)])

    def _chain(self, budgets: list[int], pick) -> list[torch.Tensor]:
        steps = max(budgets, default=0)
        lengths = self.runner.cache.lengths
        logits, tokens = self.last_logits, []
        for i in range(steps):
            tokens.append(pick(logits))
            if i + 1 < steps:  # draft i+1 goes to slot length + i of each row, after the row's earlier drafts
                step_logits, _ = self.runner.forward(tokens[-1][:, None], starts=[n + i for n in lengths])
                logits = fit_vocab(step_logits[:, -1].float(), self.vocab_size)
        self.chain_fed = max(0, steps - 1)
        drafts = torch.stack(tokens, 1) if tokens else torch.empty(len(lengths), 0, dtype=torch.long, device=self.device)
        return [drafts[b, :k] for b, k in enumerate(budgets)]

    @torch.no_grad()
    def propose_batch(self, budgets: list[int]) -> list[torch.Tensor]:
        return self._chain(budgets, lambda logits: logits.argmax(-1))

    @torch.no_grad()
    def propose_sampled_batch(self, budgets: list[int], sampling: Sampling, generator: torch.Generator | None = None):
        """Drafts sampled from the warped draft distributions, and those distributions q per row [k_b, V]."""
        q_steps: list[torch.Tensor] = []

        def pick(logits: torch.Tensor) -> torch.Tensor:
            q_steps.append(sampling.probs(logits))
            return torch.multinomial(q_steps[-1], 1, generator=generator).squeeze(1)

        drafts = self._chain(budgets, pick)
        q = torch.stack(q_steps, 1) if q_steps else None  # [B, steps, V]
        return drafts, [None if q is None else q[b, :k] for b, k in enumerate(budgets)]

    def update_batch(self, emitted: list[list[int]], states: TargetOutput) -> None:
        """Row b's emitted tokens: its accepted drafts that the chain ran stay where they are; the rest is run."""
        keep = [min(len(e) - 1, self.chain_fed) for e in emitted]
        self.runner.commit(keep)
        self.chain_fed = 0
        self._commit([e[k:] for e, k in zip(emitted, keep)])

    def select(self, rows: list[int]) -> None:
        """Keep only these rows, in this order (finished sequences leave the batch)."""
        self.runner.select(rows)
        self.last_logits = self.last_logits[torch.tensor(rows, dtype=torch.long, device=self.device)]
