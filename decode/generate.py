"""The generation loops: plain autoregressive and speculative (chains or trees), on one runner.

A chain round: the drafter proposes k tokens; the target scores [next, d_1..d_k] in one forward;
the accepted prefix plus the target's own next token are emitted. A tree round does the same for a
draft tree (decode/tree.py). One host sync per round. Greedy output is token-for-token the target's
greedy decoding, EOS and length included; sampling output follows the warped target exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from headstart.decode.clock import UNTIMED, RoundClock
from headstart.decode.drafter import Drafter
from headstart.decode.target_runner import TargetRunner
from headstart.decode.tree import DynamicTree, StaticTree, build_dynamic_tree, build_static_tree, verify_tree
from headstart.decode.typical import typical
from headstart.decode.verify import TOKEN, Sampling, Verification, verify_greedy
from headstart.models.target import TargetOutput


@dataclass
class Generation:
    tokens: list[int]  # generated tokens (prompt excluded), EOS included when hit
    target_forwards: int = 0  # after the prefill
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens per speculative round
    proposed: list[int] = field(default_factory=list)  # draft tokens proposed per round (can be < k)
    prefill_counted: bool = False
    """True when ``target_forwards`` includes the prompt's forward, because the loop verified drafts in it
    (transformers' assisted generation): every token then counts, the first included."""

    @property
    def counted_tokens(self) -> int:
        """The tokens tau counts: those after the prefill's token, or all of them when the prefill is counted."""
        return len(self.tokens) - (0 if self.prefill_counted else 1)

    @property
    def tau(self) -> float:
        """Tokens per target forward (bonus included); 1.0 for plain decoding."""
        return self.counted_tokens / max(1, self.target_forwards)


def _check_budget(max_new_tokens: int) -> None:
    """The prompt's forward always yields a token: a loop generates at least one."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1 (the prompt's forward yields the first token), got {max_new_tokens}")


def stop_at_end(tokens: list[int], eos_ids: set[int], max_new_tokens: int) -> tuple[list[int], bool]:
    """Cut at the first EOS (kept) and at max_new_tokens; report whether generation is done."""
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[: i + 1], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


def _pick(logits: torch.Tensor, sampling: Sampling | None, generator: torch.Generator | None) -> int:
    """The target's next token from its logits [V]: argmax, or one sample of the warped distribution."""
    if sampling is None:
        return int(logits.argmax())
    return int(torch.multinomial(sampling.probs(logits.unsqueeze(0)), 1, generator=generator))


def plain_generate(runner: TargetRunner, prompt_ids: torch.Tensor, max_new_tokens: int, eos_ids: set[int],
                   sampling: Sampling | None = None, generator: torch.Generator | None = None,
                   clock: RoundClock | None = None) -> Generation:
    """Autoregressive decoding on the same runner: argmax, or a sample of the warped target. ``clock``: where the
    time goes (decode/clock.py; the target's forward per token is its ``verify``)."""
    _check_budget(max_new_tokens)
    clock = clock or UNTIMED
    clock.start()
    runner.reset()
    logits, _ = runner.forward(prompt_ids)
    clock.lap("prefill")
    runner.commit(prompt_ids.shape[1])
    tokens, done = stop_at_end([_pick(logits[0, -1], sampling, generator)], eos_ids, max_new_tokens)
    out = Generation(tokens)
    while not done:
        clock.lap("other")
        logits, _ = runner.forward(torch.tensor([[tokens[-1]]], device=prompt_ids.device))
        clock.lap("verify")
        runner.commit(1)
        out.target_forwards += 1
        tokens, done = stop_at_end(tokens + [_pick(logits[0, -1], sampling, generator)], eos_ids, max_new_tokens)
    clock.lap("other")
    out.tokens = tokens
    return out


def greedy_generate(runner: TargetRunner, prompt_ids: torch.Tensor, max_new_tokens: int, eos_ids: set[int]) -> Generation:
    return plain_generate(runner, prompt_ids, max_new_tokens, eos_ids)


def speculative_generate(
    runner: TargetRunner,
    drafter: Drafter,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    eos_ids: set[int],
    k: int,
    sampling: Sampling | None = None,
    generator: torch.Generator | None = None,
    tree: DynamicTree | StaticTree | None = None,
    clock: RoundClock | None = None,
    verification: Verification = TOKEN,
) -> Generation:
    """Greedy when ``sampling`` is None (output = the target's greedy decoding), else lossless
    rejection sampling (output distributed exactly as sampling from the warped target), a chain's drafts verified
    token by token or as a block -- or, not losslessly, by typical acceptance (``verification``: decode/verify.py).

    With ``tree`` the drafter grows a tree per round (``k`` is then unused) and the target verifies
    every branch in one forward (decode/tree.py). ``clock``: where the time goes, by part (decode/clock.py)."""
    _check_budget(max_new_tokens)
    verification.check(tree is not None)
    clock = clock or UNTIMED
    clock.start()
    device = prompt_ids.device
    runner.reset()
    logits, states = runner.forward(prompt_ids)
    clock.lap("prefill")
    runner.commit(prompt_ids.shape[1])
    tokens, done = stop_at_end([_pick(logits[0, -1], sampling, generator)], eos_ids, max_new_tokens)
    clock.lap("other")
    # A self-speculative drafter runs the target's first layers on this runner's cache and verifies its own chains.
    self_verify = drafter.capabilities.self_verify
    if self_verify:
        drafter.attach(runner)
    verify = drafter.verify if self_verify else runner.forward
    drafter.begin(prompt_ids, states, tokens[0])
    clock.lap("prefill")  # the drafter reading the prompt is a prompt cost, like the target's forward over it
    out = Generation(tokens)
    while not done:
        if tree is not None:
            tokens, done = _tree_round(runner, drafter, tree, tokens, max_new_tokens, eos_ids, sampling, generator, out,
                                       clock, verification)
            continue
        # Never draft past the length limit: accepted drafts + the bonus token fit in what is left.
        budget = min(k, max_new_tokens - len(tokens) - 1)
        if sampling is not None:
            drafts, q = drafter.propose_sampled(budget, sampling, generator)
        else:
            drafts, q = drafter.propose(budget), None
        clock.lap("draft")
        drafts = drafts.to(device)
        block = torch.cat([torch.tensor([tokens[-1]], device=device), drafts]).unsqueeze(0)  # [1, 1+k']
        logits, states = verify(block)
        clock.lap("verify")
        if sampling is None:
            n_acc, nxt = verify_greedy(drafts.unsqueeze(0), logits)
        else:
            if q is None:  # a deterministic proposal is a one-hot q (EAGLE's rule for top-k children)
                q = torch.nn.functional.one_hot(drafts, logits.shape[-1]).float()
            n_acc, nxt = verification.chain(drafts.unsqueeze(0), q.unsqueeze(0), sampling.probs(logits), generator)
        # The round's one host transfer: accepted count, next token and the drafts, packed together.
        packed = torch.cat([n_acc.view(1), nxt.view(1), drafts.long()]).tolist()
        n = packed[0]
        runner.commit(1 + n)
        out.target_forwards += 1
        out.accepted.append(n)
        out.proposed.append(drafts.numel())
        emitted = packed[2 : 2 + n] + [packed[1]]
        before = len(tokens)
        tokens, done = stop_at_end(tokens + emitted, eos_ids, max_new_tokens)
        clock.lap("other")
        if not done:
            drafter.update(emitted, states.select(slice(0, n + 1)))
            clock.lap("update")
        else:
            _last_round(drafter, tokens[before:], states.select(slice(0, len(tokens) - before)), clock)
    out.tokens = tokens
    return out


def _last_round(drafter: Drafter, emitted: list[int], states: TargetOutput, clock) -> None:
    """The request's last round, as far as the output keeps it (up to its EOS or the length limit), and the states of
    the positions that produced it: a drafter that learns what it serves reads it (``finish``, timed as ``learn``); no
    update, nothing follows."""
    drafter.finish(emitted, states)
    clock.lap("learn")


def _tree_round(runner, drafter, tree, tokens, max_new_tokens, eos_ids, sampling, generator, out, clock, verification):
    """One tree round: grow, verify in one target forward, keep the accepted path's KV entries."""
    device = runner.device
    budget = max_new_tokens - len(tokens) - 1  # deepest useful node: its drafts + the bonus token fit
    build = build_dynamic_tree if isinstance(tree, DynamicTree) else build_static_tree
    draft = build(drafter, tree, budget)
    clock.lap("draft")
    block = torch.cat([torch.tensor([tokens[-1]], device=device), draft.tokens.to(device)])
    logits, states = runner.forward(block.unsqueeze(0), tree_mask=draft.block_mask, depths=draft.block_depths())
    clock.lap("verify")
    kept = None
    if sampling is None:
        choice = logits[0].argmax(-1)
    elif verification.rule == "typical":  # a node is kept where typical under its parent's p; the next token greedy
        probs = sampling.probs(logits[0])
        choice = probs.argmax(-1)
        kept = typical(probs[draft.parents + 1], draft.tokens.to(device), verification.threshold, verification.alpha)
    else:  # one sample of the warped target per node: lossless for deterministic children (verify_tree)
        choice = torch.multinomial(sampling.probs(logits[0]), 1, generator=generator).squeeze(1)
    path, emitted = verify_tree(draft, choice, block, kept)
    drafter.observed(choice)
    before = len(tokens)
    runner.keep(path)
    out.target_forwards += 1
    out.accepted.append(len(path) - 1)
    out.proposed.append(draft.max_depth)
    tokens, done = stop_at_end(tokens + emitted, eos_ids, max_new_tokens)
    clock.lap("other")
    if not done:
        drafter.update(emitted, states.select(path))
        clock.lap("update")
    else:
        _last_round(drafter, tokens[before:], states.select(path[: len(tokens) - before]), clock)
    return tokens, done
