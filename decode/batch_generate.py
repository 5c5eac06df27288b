"""Batched generation: B prompts decoded together, plain or speculative (chains), on one ``RaggedRunner``.

Each sequence keeps its own drafter, its own committed length and its own acceptance: a round drafts for every
unfinished sequence (each within its own length budget, exactly as it would alone), verifies all of them in one
target forward of [B, 1 + longest draft], and commits row b's accepted prefix and bonus token by moving row b's
length. A sequence that finishes leaves the batch. Greedy output and tau per sequence are those of decoding it
alone (decode/generate.py); sampling output follows the warped target exactly, as there.

The drafters run one sequence at a time (the ``Drafter`` interface is per sequence): the target's forward, the
memory-bound part, is what batching shares; a drafter's steps scale with B.
"""

from __future__ import annotations

import torch

from headstart.decode.clock import UNTIMED, RoundClock
from headstart.decode.generate import Drafter, Generation, Sampling, _finish
from headstart.decode.target_runner import RaggedRunner
from headstart.decode.verify import verify_greedy, verify_sampling
from headstart.models.target import TargetOutput


def _row(states: TargetOutput, b: int, n: int) -> TargetOutput:
    """Row b's states at its first n positions, as a batch of one ([1, n, ...]): what a drafter reads."""
    aux = None if states.aux_hidden_states is None else states.aux_hidden_states[b : b + 1, :n]
    return TargetOutput(aux_hidden_states=aux, last_hidden_state=states.last_hidden_state[b : b + 1, :n])


def _pick_rows(logits: torch.Tensor, sampling: Sampling | None, generator: torch.Generator | None) -> torch.Tensor:
    """One next token per row of logits [B, V]: argmax, or a sample of the warped distribution."""
    if sampling is None:
        return logits.argmax(-1)
    return torch.multinomial(sampling.probs(logits), 1, generator=generator).squeeze(1)


def _prefill(runner: RaggedRunner, prompts: list[torch.Tensor], sampling: Sampling | None,
             generator: torch.Generator | None) -> tuple[list[int], TargetOutput]:
    """All prompts ([1, T_b] each) in one forward, right-padded; returns each row's first token and the states."""
    lengths = [p.shape[1] for p in prompts]
    ids = prompts[0].new_zeros(len(prompts), max(lengths))
    for b, p in enumerate(prompts):
        ids[b, : lengths[b]] = p[0]
    runner.reset(len(prompts))
    logits, states = runner.forward(ids, valid=lengths)
    runner.commit(lengths)
    last = logits[torch.arange(len(prompts), device=ids.device), torch.tensor(lengths, device=ids.device) - 1]
    return _pick_rows(last, sampling, generator).tolist(), states


def _drop_finished(runner: RaggedRunner, active: list[int], done: list[bool]) -> list[int]:
    """The batch without its finished rows (the cache follows)."""
    keep = [i for i, b in enumerate(active) if not done[b]]
    if len(keep) < len(active):
        runner.select(keep)
    return [active[i] for i in keep]


def batch_plain_generate(runner: RaggedRunner, prompts: list[torch.Tensor], max_new_tokens: int, eos_ids: set[int],
                         sampling: Sampling | None = None, generator: torch.Generator | None = None,
                         clock: RoundClock | None = None) -> tuple[list[Generation], int]:
    """Autoregressive decoding of B prompts together. Returns each sequence's generation and the number of batched
    target forwards after the prefill (each a ``verify`` lap on the clock)."""
    clock = clock or UNTIMED
    clock.start()
    first, _ = _prefill(runner, prompts, sampling, generator)
    clock.lap("prefill")
    outs, done = [], []
    for token in first:
        tokens, finished = _finish([token], eos_ids, max_new_tokens)
        outs.append(Generation(tokens))
        done.append(finished)
    active = _drop_finished(runner, list(range(len(prompts))), done)
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
            outs[b].tokens, done[b] = _finish(outs[b].tokens + [token], eos_ids, max_new_tokens)
        active = _drop_finished(runner, active, done)
    clock.lap("other")
    return outs, steps


def batch_speculative_generate(
    runner: RaggedRunner,
    drafters: list[Drafter],
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    eos_ids: set[int],
    k: int,
    sampling: Sampling | None = None,
    generator: torch.Generator | None = None,
    clock: RoundClock | None = None,
) -> tuple[list[Generation], int]:
    """Speculative chains for B prompts ([1, T_b] each), one drafter per prompt. Greedy when ``sampling`` is None
    (each output = that prompt's greedy decoding), else lossless rejection sampling. Returns each sequence's
    generation and the number of batched rounds (target forwards after the prefill)."""
    clock = clock or UNTIMED
    clock.start()
    device = prompts[0].device
    first, states = _prefill(runner, prompts, sampling, generator)
    clock.lap("prefill")
    outs, done = [], []
    for token in first:
        tokens, finished = _finish([token], eos_ids, max_new_tokens)
        outs.append(Generation(tokens))
        done.append(finished)
    clock.lap("other")
    for b, prompt in enumerate(prompts):
        if not done[b]:
            drafters[b].begin(prompt, _row(states, b, prompt.shape[1]), first[b])
    clock.lap("update")
    active = _drop_finished(runner, list(range(len(prompts))), done)
    rounds = 0
    while active:
        drafts, qs = [], []
        for b in active:
            budget = min(k, max_new_tokens - len(outs[b].tokens) - 1)  # as alone: accepted + bonus fit the limit
            if sampling is not None and hasattr(drafters[b], "propose_sampled"):
                d, q = drafters[b].propose_sampled(budget, sampling, generator)
            else:
                d, q = drafters[b].propose(budget), None
            drafts.append(d.to(device))
            qs.append(q)
        clock.lap("draft")
        width = max(d.numel() for d in drafts)
        lengths = torch.tensor([d.numel() for d in drafts], device=device)
        padded = torch.zeros(len(active), width, dtype=torch.long, device=device)
        for i, d in enumerate(drafts):
            padded[i, : d.numel()] = d
        last = torch.tensor([outs[b].tokens[-1] for b in active], device=device)
        logits, states = runner.forward(torch.cat([last[:, None], padded], dim=1), valid=(lengths + 1).tolist())
        clock.lap("verify")
        if sampling is None:
            n_acc, nxt = verify_greedy(padded, logits, lengths)
        else:
            # A deterministic proposal is a one-hot q; padding has q = 0 and is never accepted (verify_sampling).
            q_all = logits.new_zeros(len(active), width, logits.shape[-1], dtype=torch.float)
            for i, (d, q) in enumerate(zip(drafts, qs)):
                q_all[i, : d.numel()] = torch.nn.functional.one_hot(d, logits.shape[-1]).float() if q is None else q
            n_acc, nxt = verify_sampling(padded, q_all, sampling.probs(logits), generator, lengths)
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
            out.tokens, done[b] = _finish(out.tokens + emitted, eos_ids, max_new_tokens)
            emitted_by_row.append(emitted)
        clock.lap("other")
        for i, (b, emitted) in enumerate(zip(active, emitted_by_row)):
            if not done[b]:
                drafters[b].update(emitted, _row(states, i, len(emitted)))
        clock.lap("update")
        active = _drop_finished(runner, active, done)
    clock.lap("other")
    return outs, rounds
