"""Classic speculative decoding's drafter: an independent small causal LM with the target's tokenizer, for one
sequence or a batch.

One sequence: the small model runs on a ``TargetRunner`` of its own (the target's runner: the same masks, sliding
windows and, with ``compile``, the same static cache and compiled blocks), its KV cache holding every emitted token.
Drafting runs it one level at a time (a chain is a tree with one child per node); nodes are written after the
committed slots and simply overwritten later. After a chain round, the accepted drafts the model already ran sit in
their own slots with exactly the context a re-run would give them, so they are kept and only the rest of the emitted
tokens (the bonus token, and the last draft when every draft was accepted) are run; after a tree round the emitted
tokens are re-run as one block, which is cheaper than tracking which tree slots survived.

A batch of sequences of different lengths (``begin_batch``/``propose_batch``/``update_batch``/``select``): one forward
of the small model per draft step for every row, on a ``RaggedRunner`` of its own (the batch target's ragged KV cache
and masks), built at the first batch and run eagerly (the compiled graphs are one sequence's). Row b's committed
tokens are its own, chain step i writes at each row's committed length + i, and the accepted drafts are kept in place
as for one sequence.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from headstart.decode.batch_generate import padded_rows
from headstart.decode.chain import ChainRows
from headstart.decode.drafter import Capabilities
from headstart.decode.target_runner import RaggedRunner, TargetRunner
from headstart.decode.tree import ExpandedNodes
from headstart.models.target import Target


def as_draft_target(model: PreTrainedModel) -> Target:
    """The small model under the runner's ``Target`` interface (no aux capture: a runner over it has
    ``with_aux=False``)."""
    return Target(model.eval(), capture_aux=False)


def draft_model_runner(model: PreTrainedModel, max_len: int, compile: bool = False,
                       backend: str = "inductor") -> TargetRunner:
    """The small model's runner. Build it once and hand it to every ``DraftModelDrafter``: a compiled runner's
    graphs and static cache are then compiled and allocated once, not per prompt."""
    return TargetRunner(as_draft_target(model), max_len, with_aux=False, compile=compile, backend=backend)


def fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The draft model's logits [..., V_draft] as wide as the target's (q must match p): a padded draft vocab loses
    the ids the target cannot emit (never drafted), a narrower one gets -inf for the ids it lacks."""
    width = logits.shape[-1]
    if width > vocab_size:
        return logits[..., :vocab_size]
    if width < vocab_size:
        return torch.nn.functional.pad(logits, (0, vocab_size - width), value=float("-inf"))
    return logits


class DraftModelDrafter(ChainRows):
    # A batch runs on its own ragged runner, eagerly: the compiled graphs are one sequence's.
    capabilities = Capabilities(trees=("dynamic", "static"), batches=True, sampled=True, compiled=True, confidence=True)

    def __init__(self, draft: PreTrainedModel | TargetRunner, max_len: int, target_vocab_size: int) -> None:
        """``draft``: the small model (run eagerly on a runner of its own), or ``draft_model_runner``'s runner over
        it, shared by the drafters of every prompt (each ``begin`` starts it afresh; a batch gets a ragged runner of
        its own over the same model)."""
        self.runner = draft if isinstance(draft, TargetRunner) else draft_model_runner(draft, max_len)
        if self.runner.with_aux:
            raise ValueError("a draft model's runner reads no aux states: build it with draft_model_runner")
        if self.runner.max_len != max_len:
            raise ValueError(f"the draft model's runner holds {self.runner.max_len} positions, not max_len {max_len}")
        self.max_len = self.runner.max_len
        self.target_vocab_size = target_vocab_size  # the width of the target's logits (q must match it)
        self.device = self.runner.device
        self.last_logits: torch.Tensor | None = None  # [V]: the next token after the committed ones
        self.chain_fed = 0  # drafts of the last chain run through the model, in slots committed.. (0 after a tree)
        self._rows: RaggedRunner | None = None  # the batch path's runner, built at its first batch
        self.rows_logits: torch.Tensor | None = None  # [B, V]: each row's next token after its committed ones
        self.confidence_threshold = 0.0  # > 0: a chain stops after a draft it is less sure of (decode/confidence.py)

    def precompile(self, max_block: int, trees: bool = True) -> None:
        """With a compiled runner: compile its forward for every causal block (prompt reads, chain steps) of up to
        ``max_block`` tokens now, and with ``trees`` every masked one (tree levels)."""
        sizes = range(1, max_block + 1)
        self.runner.precompile(sizes, masked=sizes if trees else ())

    def _logits(self, logits: torch.Tensor) -> torch.Tensor:
        return fit_vocab(logits[0].float(), self.target_vocab_size)

    @torch.no_grad()
    def _advance(self, ids: torch.Tensor) -> None:
        """Run and commit ids [m] after the committed tokens; keep the logits after the last of them."""
        logits, _ = self.runner.forward(ids.to(self.device).view(1, -1), last_only=True)
        self.runner.commit(ids.numel())
        self.last_logits = self._logits(logits)[-1]

    def begin(self, prompt_ids: torch.Tensor, states, next_token: int) -> None:
        self.runner.reset()
        self.chain_fed = 0  # a previous request's last chain: its slots are not this request's (a hybrid's first update)
        self._advance(torch.cat([prompt_ids[0].to(self.device), torch.tensor([next_token], device=self.device)]))

    def update(self, emitted: list[int], states) -> None:
        keep = min(len(emitted) - 1, self.chain_fed)  # accepted drafts whose KV the chain already wrote in place
        self.runner.commit(keep)
        self.chain_fed = 0
        self._advance(torch.tensor(emitted[keep:], device=self.device))

    # -- trees (decode/tree.py) ------------------------------------------------------------------
    def tree_root(self) -> torch.Tensor:
        self._expanded = ExpandedNodes(self.device)
        self.chain_fed = 0
        return self.last_logits

    @torch.no_grad()
    def tree_expand(self, parents: torch.Tensor, tokens: torch.Tensor, depth: int) -> torch.Tensor:
        """Feed m nodes at ``depth`` (position length-1+depth), each seeing the committed tokens, its
        expanded ancestors and itself; returns their children's logits [m, V]."""
        m, done, committed = tokens.numel(), self._expanded.count, self.runner.length
        new_anc = self._expanded.add(parents)  # [m, done+m]
        visible = torch.cat([torch.ones(m, committed, dtype=torch.bool, device=self.device), new_anc[:, :done]], dim=1)
        # the runner places a block's token i at its start + depths[i]: here every node sits at length-1+depth
        offsets = torch.full((m,), depth - 1 - done, device=self.device)
        logits, _ = self.runner.forward(tokens.view(1, m), tree_mask=new_anc[:, done:], depths=offsets,
                                        start=committed + done, visible=visible)
        return self._logits(logits)

    # -- chains (decode/chain.py) ---------------------------------------------------------------------
    def chain_room(self, k: int) -> int:
        self.chain_fed = 0
        return k

    def chain_logits(self, i: int, previous: torch.Tensor | None) -> torch.Tensor:
        """Draft 0's logits are the commit's; for draft i >= 1, d_i (``previous``) runs at slot committed + i - 1, after
        the committed tokens and d_1..d_{i-1} (a plain causal block, which a compiled runner runs as its one-token
        graph). d_1..d_i then sit in slots committed.. in order, which ``update`` keeps where accepted."""
        if previous is None:
            return self.last_logits
        self.chain_fed = i
        logits, _ = self.runner.forward(previous.view(1, 1), start=self.runner.length + i - 1)
        return self._logits(logits)[-1]

    # -- a batch (decode/batch_generate.py) --------------------------------------------------------
    @property
    def rows(self) -> RaggedRunner:
        """The batch path's runner over the same small model (the same ``Target`` wrapper), built at the first batch."""
        if self._rows is None:
            self._rows = RaggedRunner(self.runner.target, self.max_len, with_aux=False)
        return self._rows

    @torch.no_grad()
    def _commit_rows(self, rows: list[list[int]]) -> None:
        """Run and commit row b's tokens rows[b] (at least one each); keep the logits after each row's last."""
        tokens, counts = padded_rows(rows, self.device)
        logits, _ = self.rows.forward(tokens, valid=counts, last_only=True)
        self.rows.commit(counts)
        self.rows_logits = fit_vocab(logits.float(), self.target_vocab_size)

    def begin_batch(self, prompts: list[torch.Tensor], states, next_tokens: list[int]) -> None:
        self.rows.reset(len(prompts))
        self.chain_fed = 0
        self._commit_rows([p[0].tolist() + [t] for p, t in zip(prompts, next_tokens)])

    @torch.no_grad()
    def chain_rows(self, steps: int, pick) -> torch.Tensor:
        """Every row's chain, one forward a step: draft i+1 at each row's slot length + i, after the row's earlier
        drafts."""
        lengths = self.rows.cache.lengths
        logits, tokens = self.rows_logits, []
        for i in range(steps):
            tokens.append(pick(logits))
            if i + 1 < steps:
                step_logits, _ = self.rows.forward(tokens[-1][:, None], starts=[n + i for n in lengths])
                logits = fit_vocab(step_logits[:, -1].float(), self.target_vocab_size)
        self.chain_fed = max(0, steps - 1)
        return torch.stack(tokens, 1) if tokens else torch.empty(len(lengths), 0, dtype=torch.long, device=self.device)

    def update_batch(self, emitted: list[list[int]], states) -> None:
        """Row b's emitted tokens: its accepted drafts that the chain ran stay where they are; the rest is run."""
        keep = [min(len(e) - 1, self.chain_fed) for e in emitted]
        self.rows.commit(keep)
        self.chain_fed = 0
        self._commit_rows([e[k:] for e, k in zip(emitted, keep)])

    def select(self, rows: list[int]) -> None:
        """Keep only these rows, in this order (finished sequences leave the batch)."""
        self.rows.select(rows)
        self.rows_logits = self.rows_logits[torch.tensor(rows, dtype=torch.long, device=self.device)]
