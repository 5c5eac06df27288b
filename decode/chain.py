"""The draft chain, written once: draft i is picked from the drafter's logits given draft i-1 (Leviathan et al.'s and
Chen et al.'s draft loop, which every sequential drafter runs -- EAGLE-3, MTP, Hydra, early exit, a draft model).

A ``ChainDrafter`` says what differs between them -- the logits of draft i given draft i-1 (``chain_logits``, in its own
draft vocab, possibly a truncated one), how many drafts fit this round (``chain_room``), and where its draft vocab sits
in the target's (``to_target``, ``draft_vocab``) -- and gets the rest: greedy chains (``propose``: argmax), sampled
chains (``propose_sampled``: each draft drawn from the warped distribution given the draws before it, q returned over
the target's vocab) and the ``--confidence-threshold`` stop (decode/confidence.py) in both. The order of operations is
the one every drafter had: step, pick, then the stop rule, so a step runs only for a draft that will be proposed.

``ChainRows`` does the same for a batch whose rows all step in one forward (the one-layer drafter, the draft model):
the drafter supplies ``chain_rows`` (``steps`` steps for every row, each picked by a function it is given) and gets
greedy and sampled batch chains, each row cut to its budget.
"""

from __future__ import annotations

import torch

from headstart.decode.confidence import confident
from headstart.decode.drafter import Drafter
from headstart.decode.verify import Sampling


class ChainDrafter(Drafter):
    """A drafter whose drafts come one after another, each read by the next step. Subclasses set ``device`` and
    ``target_vocab_size`` (the width of q: the target's logits) and implement ``chain_logits``."""

    device: torch.device
    target_vocab_size: int

    def chain_room(self, k: int) -> int:
        """How many of the k drafts asked for this round's chain may run (the heads it has, the cache left), and the
        round's start: a subclass resets what its steps carry here. Default: all k."""
        return k

    def chain_logits(self, i: int, previous: torch.Tensor | None) -> torch.Tensor:
        """The logits [V'] over the draft vocab for draft i (0-based) of this round's chain, given draft i-1 as a target
        id (0-dim; None for draft 0, whose logits the last commit left)."""
        raise NotImplementedError

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids -> the target's ids (the identity where the drafter drafts in the target's vocab)."""
        return ids

    def draft_vocab(self) -> torch.Tensor | None:
        """The target ids [V'] of the draft vocab, in draft-vocab order, where it is a truncated one; None: the
        target's whole vocab."""
        return None

    @torch.no_grad()
    def _run_chain(self, k: int, pick) -> torch.Tensor:
        """Up to k drafts as target ids [k'], fewer where ``chain_room`` or ``confidence_threshold`` stops the chain;
        ``pick(logits [V']) -> (draft id (0-dim), the q it was drawn from [V'] or None for argmax)``."""
        tokens: list[torch.Tensor] = []
        previous = None
        for i in range(self.chain_room(k)):
            logits = self.chain_logits(i, previous)
            draft, q = pick(logits)
            previous = self.to_target(draft)
            tokens.append(previous)
            if not confident(logits, draft, self.confidence_threshold, q):
                break
        return torch.stack(tokens) if tokens else torch.empty(0, dtype=torch.long, device=self.device)

    def propose(self, k: int) -> torch.Tensor:
        return self._run_chain(k, lambda logits: (logits.argmax(-1), None))

    def propose_sampled(self, k: int, sampling: Sampling, generator: torch.Generator | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each draft drawn from the warped draft distribution given the draws before it: (target ids [k'], q [k', V]),
        q over the target's vocab (``on_target_vocab``)."""
        qs: list[torch.Tensor] = []

        def draw(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            qs.append(sampling.probs(logits))  # [V']
            return torch.multinomial(qs[-1], 1, generator=generator).view(()), qs[-1]

        tokens = self._run_chain(k, draw)
        if not qs:
            return tokens, torch.zeros(0, self.target_vocab_size, device=self.device)
        return tokens, self.on_target_vocab(torch.stack(qs))

    def on_target_vocab(self, q: torch.Tensor) -> torch.Tensor:
        """Distributions over the draft vocab [..., V'] -> over the target's [..., V]: zero outside a truncated draft
        vocab (the verification's p/q ratio reads both on one vocab, and a token the drafter cannot propose has q = 0)."""
        ids = self.draft_vocab()
        if ids is None:
            return q
        full = q.new_zeros(*q.shape[:-1], self.target_vocab_size)
        full[..., ids] = q
        return full


class ChainRows(ChainDrafter):
    """A ``ChainDrafter`` whose batch rows draft together, one forward a step: subclasses implement ``chain_rows``."""

    def chain_rows(self, steps: int, pick) -> torch.Tensor:
        """``steps`` drafts for every row of the batch, draft i read by step i+1; ``pick(logits [B, V']) -> draft
        ids [B]``. Returns target ids [B, steps]."""
        raise NotImplementedError

    @torch.no_grad()
    def propose_batch(self, budgets: list[int]) -> list[torch.Tensor]:
        drafts = self.chain_rows(max(budgets, default=0), lambda logits: logits.argmax(-1))
        return [drafts[b, :k] for b, k in enumerate(budgets)]

    @torch.no_grad()
    def propose_sampled_batch(self, budgets: list[int], sampling: Sampling, generator: torch.Generator | None = None
                              ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each row's drafts drawn from the warped draft distribution given its draws before: per row (target ids
        [k_b], q [k_b, V]), q over the target's vocab (``propose_sampled``'s)."""
        q_steps: list[torch.Tensor] = []

        def pick(logits: torch.Tensor) -> torch.Tensor:
            q_steps.append(sampling.probs(logits))  # [B, V']
            return torch.multinomial(q_steps[-1], 1, generator=generator).squeeze(1)

        drafts = self.chain_rows(max(budgets, default=0), pick)
        q = self.on_target_vocab(torch.stack(q_steps, dim=1)) if q_steps else \
            torch.zeros(drafts.shape[0], 0, self.target_vocab_size, device=self.device)
        return [drafts[b, :k] for b, k in enumerate(budgets)], [q[b, :k] for b, k in enumerate(budgets)]


class SelfDraftChain(ChainDrafter):
    """A chain the target drafts for itself on its own runner and KV cache (``attach``; self-speculation: early exit,
    layer skipping): each round starts from the bonus token at the first uncommitted slot, which the loop's
    ``verify`` must find unchanged. A subclass's ``chain_room`` calls ``start_round``."""

    runner = None
    bonus = 0
    _start = 0
    what = "this drafter"
    """How the refusals name it."""

    def attach(self, runner) -> None:
        self.runner = runner

    def begin(self, prompt_ids: torch.Tensor, states, next_token: int) -> None:
        if self.runner is None:
            raise ValueError(f"{self.what} drafts on the target's runner: the loop must attach it first")
        self.bonus = int(next_token)

    def update(self, emitted: list[int], states) -> None:
        self.bonus = int(emitted[-1])

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def start_round(self, k: int) -> int:
        """The round's first slot recorded; how many of k drafts fit (verification writes the bonus token and them)."""
        self._start = self.runner.length
        return max(min(k, self.runner.max_len - self._start - 1), 0)

    def check_slot(self) -> None:
        """``verify``'s block must sit where this round drafted from (the loop verifies right after proposing)."""
        if self._start != self.runner.length:
            raise ValueError(f"{self.what} verify: the block is not at the slot it just drafted from ({self._start}; "
                             f"the runner's committed length is {self.runner.length})")
