"""Batched generation: B prompts decoded together, plain or speculative (chains), on one ``RaggedRunner``.

Each sequence keeps its own drafter, its own committed length and its own acceptance: a round drafts for every
unfinished sequence (each within its own length budget, exactly as it would alone), verifies all of them in one
target forward of [B, 1 + longest draft], and commits row b's accepted prefix and bonus token by moving row b's
length. A sequence that finishes leaves the batch. Greedy output and tau per sequence are those of decoding it
alone (decode/generate.py); sampling output follows the warped target exactly, as there.

The drafter is a ``BatchDrafter``: a head's drafter (heads/<name>/drafter.py: one draft forward per step for every
row, a batch of any size), the draft model's batched drafter, else ``PerSequence`` over one-sequence drafters (n-gram
lookup), whose cost grows with B. Its methods carry ``_batch`` in their names, so one class can be both a ``Drafter``
(decode/generate.py) and a ``BatchDrafter``.
"""

from __future__ import annotations

from typing import Protocol

import torch

from headstart.decode.clock import UNTIMED, RoundClock
from headstart.decode.drafter import Capabilities, Drafter
from headstart.decode.generate import Generation, Sampling, stop_at_end
from headstart.decode.target_runner import RaggedRunner
from headstart.decode.verify import TOKEN, Verification, verify_greedy
from headstart.models.target import TargetOutput


def _row(states: TargetOutput, b: int, n: int) -> TargetOutput:
    """Row b's states at its first n positions, as a batch of one ([1, n, ...]): what a drafter reads."""
    aux = None if states.aux_hidden_states is None else states.aux_hidden_states[b : b + 1, :n]
    return TargetOutput(aux_hidden_states=aux, last_hidden_state=states.last_hidden_state[b : b + 1, :n])


def shifted_prompts(prompts: list[torch.Tensor], next_tokens: list[int]) -> tuple[torch.Tensor, list[int]]:
    """What a drafter commits first, per row: prompt tokens 1.. and the first generated token, right-padded to
    [B, T_max] (pair j: the target's state at j with token j+1), and each row's length T_b."""
    counts = [p.shape[1] for p in prompts]
    tokens = prompts[0].new_zeros(len(prompts), max(counts))
    for b, (p, nxt) in enumerate(zip(prompts, next_tokens)):
        tokens[b, : counts[b] - 1] = p[0, 1:]
        tokens[b, counts[b] - 1] = nxt
    return tokens, counts


def padded_rows(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """Token lists of different lengths -> [B, longest] right-padded with 0, and each row's length."""
    counts = [len(r) for r in rows]
    return torch.tensor([r + [0] * (max(counts) - len(r)) for r in rows], device=device), counts


def _pick_rows(logits: torch.Tensor, sampling: Sampling | None, generator: torch.Generator | None) -> torch.Tensor:
    """One next token per row of logits [B, V]: argmax, or a sample of the warped distribution."""
    if sampling is None:
        return logits.argmax(-1)
    return torch.multinomial(sampling.probs(logits), 1, generator=generator).squeeze(1)


def _prefill(runner: RaggedRunner, prompts: list[torch.Tensor], max_new_tokens: int, eos_ids: set[int],
             sampling: Sampling | None, generator: torch.Generator | None
             ) -> tuple[list[Generation], list[bool], list[int], TargetOutput]:
    """All prompts ([1, T_b] each) in one forward, right-padded: each row's generation so far (its first token),
    whether it is already done, the first tokens, and the target's states."""
    lengths = [p.shape[1] for p in prompts]
    ids = prompts[0].new_zeros(len(prompts), max(lengths))
    for b, p in enumerate(prompts):
        ids[b, : lengths[b]] = p[0]
    runner.reset(len(prompts))
    last, states = runner.forward(ids, valid=lengths, last_only=True)
    runner.commit(lengths)
    first = _pick_rows(last, sampling, generator).tolist()
    outs, done = [], []
    for token in first:
        tokens, finished = stop_at_end([token], eos_ids, max_new_tokens)
        outs.append(Generation(tokens))
        done.append(finished)
    return outs, done, first, states


def _drop_finished(runner: RaggedRunner, drafter, active: list[int], done: list[bool]) -> tuple[list[int], list[int]]:
    """The batch without its finished rows, and the batch indices of those kept (the target's cache and the
    drafter, when given, follow)."""
    keep = [i for i, b in enumerate(active) if not done[b]]
    if len(keep) < len(active):
        runner.select(keep)
        if drafter is not None:
            drafter.select(keep)
    return [active[i] for i in keep], keep


def batch_plain_generate(runner: RaggedRunner, prompts: list[torch.Tensor], max_new_tokens: int, eos_ids: set[int],
                         sampling: Sampling | None = None, generator: torch.Generator | None = None,
                         clock: RoundClock | None = None) -> tuple[list[Generation], int]:
    """Autoregressive decoding of B prompts together. Returns each sequence's generation and the number of batched
    target forwards after the prefill (each a ``verify`` lap on the clock)."""
    clock = clock or UNTIMED
    clock.start()
    outs, done, _, _ = _prefill(runner, prompts, max_new_tokens, eos_ids, sampling, generator)
    clock.lap("prefill")
    active, _ = _drop_finished(runner, None, list(range(len(prompts))), done)
    steps = 0
    device = prompts[0].device
    while active:
        clock.lap("other")
        logits, _ = runner.forward(torch.tensor([[outs[b].tokens[-1]] for b in active], device=device))
        clock.lap("verify")
        runner.commit([1] * len(active))
        steps += 1
        for b, token in zip(active, _pick_rows(logits[:, -1], sampling, generator).tolist()):
            outs[b].target_forwards += 1
            outs[b].tokens, done[b] = stop_at_end(outs[b].tokens + [token], eos_ids, max_new_tokens)
        active, _ = _drop_finished(runner, None, active, done)
    clock.lap("other")
    return outs, steps


class BatchDrafter(Protocol):
    """A drafter for a batch (its rows follow the loop's active rows): a head's drafter runs one draft forward for
    every row; ``PerSequence`` adapts any one-sequence ``Drafter``. With sampling the loop calls
    ``propose_sampled_batch(budgets, sampling, generator) -> (drafts, q per row [k_b, V] or None: one-hot)``."""

    capabilities: Capabilities

    def begin_batch(self, prompts: list[torch.Tensor], states: TargetOutput, next_tokens: list[int]) -> None:
        """Prompts [1, T_b], the target's states over the right-padded prefill [B, T_max, ...], first tokens."""

    def propose_batch(self, budgets: list[int]) -> list[torch.Tensor]:
        """Up to budgets[b] draft tokens for row b."""

    def propose_sampled_batch(self, budgets: list[int], sampling: Sampling, generator: torch.Generator | None = None
                              ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Row b's drafts and the distribution q they were drawn from (None: deterministic, one-hot q)."""

    def update_batch(self, emitted: list[list[int]], states: TargetOutput) -> None:
        """Row b's emitted tokens; the target's states [B, n_max, ...] of the positions that produced them."""

    def select(self, rows: list[int]) -> None:
        """Keep only these rows, in this order."""


class PerSequence:
    """A ``BatchDrafter`` of one-sequence drafters, each run on its own row (draft cost grows with the batch)."""

    capabilities = Capabilities(batches=True)  # eager, one row after another

    def __init__(self, drafters: list[Drafter]) -> None:
        self.drafters = drafters

    def begin_batch(self, prompts: list[torch.Tensor], states: TargetOutput, next_tokens: list[int]) -> None:
        for b, (d, p) in enumerate(zip(self.drafters, prompts)):
            d.begin(p, _row(states, b, p.shape[1]), next_tokens[b])

    def propose_batch(self, budgets: list[int]) -> list[torch.Tensor]:
        return [d.propose(k) for d, k in zip(self.drafters, budgets)]

    def propose_sampled_batch(self, budgets: list[int], sampling: Sampling, generator: torch.Generator | None = None):
        drafts, qs = [], []
        for d, k in zip(self.drafters, budgets):
            tokens, q = d.propose_sampled(k, sampling, generator)
            drafts.append(tokens)
            qs.append(q)
        return drafts, qs

    def update_batch(self, emitted: list[list[int]], states: TargetOutput) -> None:
        for b, (d, e) in enumerate(zip(self.drafters, emitted)):
            d.update(e, _row(states, b, len(e)))

    def select(self, rows: list[int]) -> None:
        self.drafters = [self.drafters[r] for r in rows]


class RowByRow(Drafter):
    """The batch methods of a one-sequence drafter that drafts a batch one row after another: ``begin_batch`` makes a
    fresh drafter per row (``row_drafter``) and the rest delegate to their ``PerSequence``."""

    rows: PerSequence | None = None

    def row_drafter(self) -> Drafter:
        """A fresh drafter of the same head and settings, for one row."""
        raise NotImplementedError

    def begin_batch(self, prompts: list[torch.Tensor], states: TargetOutput, next_tokens: list[int]) -> None:
        self.rows = PerSequence([self.row_drafter() for _ in prompts])
        self.rows.begin_batch(prompts, states, next_tokens)

    def propose_batch(self, budgets: list[int]) -> list[torch.Tensor]:
        return self.rows.propose_batch(budgets)

    def propose_sampled_batch(self, budgets: list[int], sampling: Sampling, generator: torch.Generator | None = None):
        return self.rows.propose_sampled_batch(budgets, sampling, generator)

    def update_batch(self, emitted: list[list[int]], states: TargetOutput) -> None:
        self.rows.update_batch(emitted, states)

    def select(self, rows: list[int]) -> None:
        self.rows.select(rows)


def _rows(states: TargetOutput, rows: list[int]) -> TargetOutput:
    index = torch.tensor(rows, dtype=torch.long, device=states.last_hidden_state.device)
    aux = None if states.aux_hidden_states is None else states.aux_hidden_states[index]
    return TargetOutput(aux_hidden_states=aux, last_hidden_state=states.last_hidden_state[index])


def batch_speculative_generate(
    runner: RaggedRunner,
    drafter: BatchDrafter,
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    eos_ids: set[int],
    k: int,
    sampling: Sampling | None = None,
    generator: torch.Generator | None = None,
    clock: RoundClock | None = None,
    verification: Verification = TOKEN,
) -> tuple[list[Generation], int]:
    """Speculative chains for B prompts ([1, T_b] each), ``drafter`` holding one row per prompt. Greedy when
    ``sampling`` is None (each output = that prompt's greedy decoding), else lossless rejection sampling, each row's
    chain verified by ``verification``'s rule (decode/verify.py). Returns each
    sequence's generation and the number of batched rounds (target forwards after the prefill)."""
    clock = clock or UNTIMED
    clock.start()
    device = prompts[0].device
    outs, done, first, states = _prefill(runner, prompts, max_new_tokens, eos_ids, sampling, generator)
    clock.lap("prefill")
    drafter.begin_batch(prompts, states, first)
    clock.lap("prefill")  # the drafters reading the prompts: a prompt cost
    active, _ = _drop_finished(runner, drafter, list(range(len(prompts))), done)
    rounds = 0
    while active:
        budgets = [min(k, max_new_tokens - len(outs[b].tokens) - 1) for b in active]  # as alone: the drafts fit
        if sampling is not None:
            drafts, qs = drafter.propose_sampled_batch(budgets, sampling, generator)
        else:
            drafts, qs = drafter.propose_batch(budgets), [None] * len(active)
        clock.lap("draft")
        drafts = [d.to(device) for d in drafts]
        counts = [d.numel() for d in drafts]
        width = max(counts)
        lengths = torch.tensor(counts, device=device)
        padded = torch.zeros(len(active), width, dtype=torch.long, device=device)
        for i, d in enumerate(drafts):
            padded[i, : d.numel()] = d
        last = torch.tensor([outs[b].tokens[-1] for b in active], device=device)
        logits, states = runner.forward(torch.cat([last[:, None], padded], dim=1), valid=[c + 1 for c in counts])
        clock.lap("verify")
        if sampling is None:
            n_acc, nxt = verify_greedy(padded, logits, lengths)
        else:
            # A deterministic proposal is a one-hot q; padding has q = 0 and is never accepted (either rule).
            q_all = logits.new_zeros(len(active), width, logits.shape[-1], dtype=torch.float)
            for i, (d, q) in enumerate(zip(drafts, qs)):
                q_all[i, : d.numel()] = torch.nn.functional.one_hot(d, logits.shape[-1]).float() if q is None else q
            n_acc, nxt = verification.chain(padded, q_all, sampling.probs(logits), generator, lengths)
        # The round's one host transfer: accepted counts, next tokens and the drafts, packed together.
        packed = torch.cat([n_acc[:, None], nxt[:, None], padded], dim=1).tolist()
        runner.commit([1 + row[0] for row in packed])
        rounds += 1
        emitted_by_row = []
        for b, row, d in zip(active, packed, drafts):
            n = row[0]
            out = outs[b]
            out.target_forwards += 1
            out.accepted.append(n)
            out.proposed.append(d.numel())
            emitted = row[2 : 2 + n] + [row[1]]
            out.tokens, done[b] = stop_at_end(out.tokens + emitted, eos_ids, max_new_tokens)
            emitted_by_row.append(emitted)
        active, kept = _drop_finished(runner, drafter, active, done)  # bookkeeping: the caches lose finished rows
        clock.lap("other")
        if active:  # the drafter reads what its surviving rows emitted
            drafter.update_batch([emitted_by_row[i] for i in kept], states if len(kept) == len(packed) else _rows(states, kept))
        clock.lap("update")
    clock.lap("other")
    return outs, rounds
