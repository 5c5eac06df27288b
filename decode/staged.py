"""Staged speculative decoding (Spector & Re, 2023): the draft is itself drafted. A draft model's chain costs one forward
of the small model a draft; here n-gram lookup over the request (the cheaper stage below) guesses how the draft model's
chain goes on, and the draft model checks the guesses in one forward, as the target checks the draft model's.

A round of k drafts: the draft model's next token t (from its last forward), then what followed the latest earlier
occurrence of the context's suffix (the request and the drafts so far), run as one block [t, g_1, .., g_m] through
the draft model; each guess is kept while it is the draft model's own pick given the ones before it, and the first
pick that differs is the next t. So the drafts are exactly the draft model's chain -- its argmax, or its samples, each
drawn from its distribution q given the drafts before it, which the target's rejection sampling reads -- in fewer
forwards of the small model wherever the text repeats itself. Greedy tau is the draft model's own; what changes is the
draft time (the run's mode reports the draft model's forwards per draft).

With ``tree`` (``--staged-tree``) a round is the tree of both stages: the draft model's chain and n-gram lookup's own
chain from the context, merged into one trie the target verifies in one forward (Spector & Re's tree of stages), so
a round where n-gram lookup is right and the draft model is not still counts. The tree is verified node by node,
losslessly under sampling too, but without the draft model's q (one sample of the target per node).

Only a causal LM can be a stage that checks guesses: it scores a block of tokens in one forward. A head such as
EAGLE-3 reads its own previous step's hidden state for each draft, so its chain cannot be checked in one pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from headstart.decode.draft_model import DraftModelDrafter
from headstart.decode.drafter import Capabilities
from headstart.decode.ngram import prompt_lookup
from headstart.decode.tree import DraftTree, DynamicTree, OwnTree, Trie
from headstart.decode.verify import Sampling


@dataclass
class StageCounts:
    """The draft model's forwards and the drafts they gave, over every drafter of a run (they share it)."""

    forwards: int = 0
    drafts: int = 0

    def reset(self) -> None:
        """Forget the counts so far (an untimed warm-up's)."""
        self.forwards = self.drafts = 0

    def describe(self) -> str:
        return (f"draft model {self.forwards / self.drafts:.2f} forwards a draft ({self.drafts} drafts)" if self.drafts
                else "no drafts yet")


def staged_tree(k: int) -> OwnTree:
    """``--staged-tree``'s round: two chains of up to k drafts."""
    return OwnTree(depth=k, topk=2, total_tokens=2 * k, about=f"staged tree of two chains k={k}")


class StagedDrafter(DraftModelDrafter):
    """The draft model (decode/draft_model.py: its runner, its cache kept across rounds) with n-gram lookup of
    ``max_ngram`` below it. Chains, greedy or sampled, one sequence."""

    # Chains with q; with --staged-tree, a tree of its own (both stages' chains) every round.
    capabilities = Capabilities(trees=("own",), sampled=True)

    def __init__(self, draft, max_len: int, target_vocab_size: int, max_ngram: int = 3,
                 counts: StageCounts | None = None) -> None:
        super().__init__(draft, max_len, target_vocab_size)
        self.max_ngram = max_ngram
        self.counts = counts if counts is not None else StageCounts()
        self.context: list[int] = []  # the request's tokens, for the stage below
        self.drafts: list[int] = []  # the round's drafts of the draft model, the first ``chain_fed`` in its cache

    def begin(self, prompt_ids: torch.Tensor, states, next_token: int) -> None:
        super().begin(prompt_ids, states, next_token)
        self.context = prompt_ids[0].tolist() + [next_token]

    def update(self, emitted: list[int], states) -> None:
        """The draft model keeps the drafts it ran that were emitted (a tree's accepted path may be n-gram lookup's)."""
        same = 0
        while same < min(len(emitted) - 1, self.chain_fed) and emitted[same] == self.drafts[same]:
            same += 1
        self.chain_fed = same
        super().update(emitted, states)
        self.context += emitted

    def grow_tree(self, spec: DynamicTree, max_depth: int) -> DraftTree:
        """The tree of stages (``OwnTree`` of depth k): the draft model's greedy chain and n-gram lookup's, one trie."""
        k = min(spec.depth, max_depth)
        trie = Trie()
        trie.add(self._staged(k, lambda logits: (int(logits.argmax()), None))[0])
        trie.add(prompt_lookup(self.context, k, self.max_ngram))
        return trie.tree(self.device)

    def propose(self, k: int) -> torch.Tensor:
        tokens, _ = self._staged(k, lambda logits: (int(logits.argmax()), None))
        return torch.tensor(tokens, dtype=torch.long, device=self.device)

    def propose_sampled(self, k: int, sampling: Sampling, generator: torch.Generator | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        def draw(logits: torch.Tensor) -> tuple[int, torch.Tensor]:
            q = sampling.probs(logits)
            return int(torch.multinomial(q, 1, generator=generator)), q

        tokens, qs = self._staged(k, draw)
        q = torch.stack(qs) if qs else torch.empty(0, self.target_vocab_size, device=self.device)
        return torch.tensor(tokens, dtype=torch.long, device=self.device), q

    @torch.no_grad()
    def _staged(self, k: int, pick: Callable[[torch.Tensor], tuple[int, torch.Tensor | None]]
                ) -> tuple[list[int], list[torch.Tensor | None]]:
        """Up to k drafts of the draft model and their q, its forwards over blocks of a pick and the guesses after it.
        The drafts it ran sit in slots committed.. in order (``chain_fed``), kept by ``update`` where accepted."""
        drafts: list[int] = []
        qs: list[torch.Tensor | None] = []
        committed, self.chain_fed = self.runner.length, 0
        pending = pick(self.last_logits) if k > 0 else None
        while len(drafts) < k:
            token, q = pending
            drafts.append(token)
            qs.append(q)
            room = k - len(drafts)
            if room == 0:
                break
            guesses = prompt_lookup(self.context + drafts, room, self.max_ngram)
            block = torch.tensor([[token, *guesses]], device=self.device)
            logits = self._logits(self.runner.forward(block, start=committed + self.chain_fed)[0])  # [1 + m, V]
            self.chain_fed += 1
            self.counts.forwards += 1
            pending = None
            for j, guess in enumerate(guesses):
                picked = pick(logits[j])
                if picked[0] != guess:  # the draft model's own pick: the next draft, not yet run
                    pending = picked
                    break
                drafts.append(guess)
                qs.append(picked[1])
                self.chain_fed += 1
            if pending is None:
                pending = pick(logits[len(guesses)])
        self.counts.drafts += len(drafts)
        self.drafts = drafts
        return drafts, qs
