"""P-EAGLE drafting: one draft forward a round, for one sequence or a batch (vLLM's parallel drafting).

A commit (the prompt, then each round's emitted tokens) is held until the round's ``propose``: its pairs
(f_j, x_{j+1}) and k-1 placeholder pairs (``mask_hidden``, ``mask_token_id``) after the last of them run as one causal
block on the draft's KV cache -- the committed pairs written for good, the placeholders in speculative slots the next
commit overwrites. The outputs at the last committed position and at the k-1 placeholders are the round's k drafts
(heads/peagle/module.py): EAGLE-3 runs its layer 1 + (k-1) times a round, P-EAGLE once.

The drafts of a round are independent given the context, so a tree is Medusa's: a node at depth d has depth d's
candidates whatever its parent (``tree_expand`` runs nothing). Sampling draws each depth from its own distribution:
the usual verification is lossless for any draft distribution fixed before the draw (decode/generate.py).
EAGLE-3's drafter (heads/eagle3/drafter.py, on decode/layer_drafter.py) supplies the cache, the step, the vocab map
and the ragged batch cache.
"""

from __future__ import annotations

import torch

from headstart.decode.confidence import confident_prefix
from headstart.heads.eagle3.drafter import Eagle3Drafter
from headstart.heads.peagle.module import PEagleDraft
from headstart.models.target import TargetOutput


class PEagleDrafter(Eagle3Drafter):
    def __init__(self, head: PEagleDraft, max_len: int, compile: bool = False, backend: str = "inductor") -> None:
        super().__init__(head, max_len, compile=compile, backend=backend)
        self.depths = head.config.parallel_tokens
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # committed pairs not yet run: aux, tokens
        self.last_pair: tuple[torch.Tensor, torch.Tensor] | None = None  # the last pair a round ran (aux, token)
        self.rows_pending: tuple[torch.Tensor, torch.Tensor, list[int]] | None = None  # a batch's: aux, tokens, counts
        self.tree_logits: torch.Tensor | None = None  # [K, V_d] a tree round's depths

    def placeholders(self, rows: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """n placeholder pairs for each of ``rows``: aux [rows, n, n_aux * H_t] and tokens [rows, n]."""
        head = self.head
        aux = head.mask_hidden.to(head.fc.weight.dtype).expand(rows, n, -1)
        return aux, torch.full((rows, n), head.config.mask_token_id, dtype=torch.long, device=self.device)

    # -- one sequence -------------------------------------------------------------------------------
    def precompile(self, max_block: int, trees: bool = True) -> None:
        """With ``compile``: the round's block for every size up to a commit of ``max_block`` plus its placeholders (a
        tree runs no step: nothing masked to compile)."""
        super().precompile(max_block + self.depths - 1, trees=False)

    def _static_commit(self, aux_hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                       allowed: torch.Tensor) -> torch.Tensor:
        """The round's block at static shapes: the layer's outputs [1, m, H] (the caller reads the last k)."""
        return self._static_step(self.project(aux_hidden), tokens, positions, allowed)

    def begin(self, prompt_ids: torch.Tensor, states: TargetOutput, next_token: int) -> None:
        self.pending = self.last_pair = None
        super().begin(prompt_ids, states, next_token)

    def _commit(self, aux_hidden: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Hold the pairs for the next round's forward (a commit with no round between them joins the held ones)."""
        if self.pending is not None:
            aux_hidden = torch.cat([self.pending[0], aux_hidden], dim=1)
            next_tokens = torch.cat([self.pending[1], next_tokens], dim=1)
        self.pending = (aux_hidden, next_tokens)

    @torch.no_grad()
    def _round(self, k: int) -> torch.Tensor:
        """The held pairs and k-1 placeholders in one forward: the k drafts' logits [k, V_d]. Without held pairs (a
        second round on the same commit: ``decode/predict.py`` times repeated proposals) the last committed pair runs
        again at its own slot, which rewrites its keys unchanged."""
        k = max(1, min(k, self.depths))
        if self.pending is not None:
            (aux, tokens), start = self.pending, self.length
        elif self.last_pair is not None:
            (aux, tokens), start = self.last_pair, self.length - 1
        else:
            raise RuntimeError("a P-EAGLE round needs the pairs of a commit: begin/update before propose")
        n = tokens.shape[1]
        self.last_pair = (aux[:, -1:], tokens[:, -1:])
        more_aux, more_tokens = self.placeholders(1, k - 1)
        aux, tokens = torch.cat([aux, more_aux], dim=1), torch.cat([tokens, more_tokens], dim=1)
        if self._commits is not None:
            self.cache.begin(start)
            out = self._commits.causal(aux, tokens, start)
        else:
            out = self._step(self.project(aux), tokens, start)
        self.cache.rollback(start + n)  # the placeholders' slots are speculative: the next round's pairs overwrite them
        self.pending = None
        self.last_hidden = out[:, n - 1 : n]
        return self._logits(out[:, n - 1 :])[0]

    @torch.no_grad()
    def propose(self, k: int) -> torch.Tensor:
        logits = self._round(k)[:k]
        drafts = logits.argmax(-1)
        return self.to_target(drafts[: confident_prefix(logits, drafts, self.confidence_threshold)])

    @torch.no_grad()
    def propose_sampled(self, k: int, sampling, generator: torch.Generator | None = None):
        """Each depth's draft sampled from its warped distribution: (tokens [k], q [k, V]), q over the target vocab
        (zero outside the draft vocab)."""
        q_draft = sampling.probs(self._round(k)[:k])  # [k, V_d]
        drafts = torch.multinomial(q_draft, 1, generator=generator).view(-1)
        return self.to_target(drafts), self.on_target_vocab(q_draft)

    # -- trees (decode/tree.py): Medusa's, from one round's depths ----------------------------------
    def dynamic_tree(self, spec) -> None:
        return None  # grown level by level from the round's logits: nothing to compile

    def tree_root(self) -> torch.Tensor:
        self.tree_logits = self._round(self.depths)
        return self.tree_logits[0]

    def tree_expand(self, parents: torch.Tensor, tokens: torch.Tensor, depth: int) -> torch.Tensor:
        """The children of m nodes at ``depth`` are depth+1's candidates, the same for every node."""
        if depth >= self.depths:
            raise ValueError(f"this P-EAGLE head drafts {self.depths} tokens a round; a tree deeper than "
                             f"{self.depths} levels cannot be drafted (lower --tree-depth)")
        return self.tree_logits[depth].expand(tokens.numel(), -1)

    # -- a batch (decode/batch_generate.py) ----------------------------------------------------------
    def precompile_batch(self, batch: int, max_block: int) -> None:
        super().precompile_batch(batch, max_block + self.depths - 1)

    def _commit_rows(self, aux_hidden: torch.Tensor, tokens: torch.Tensor, counts: list[int]) -> None:
        """Hold row b's next counts[b] pairs (aux [B, n, W], tokens [B, n], padded past counts[b]) for the round."""
        self.rows_pending = (aux_hidden, tokens, list(counts))

    @torch.no_grad()
    def _round_rows(self, k: int) -> torch.Tensor:
        """Every row's held pairs and k-1 placeholders right after them, one forward: logits [B, k, V_d]."""
        aux, tokens, counts = self.rows_pending
        B, n = tokens.shape
        k = max(1, min(k, self.depths))
        block_aux, block_tokens = self.placeholders(B, n + k - 1)
        block_aux, block_tokens = block_aux.clone(), block_tokens.clone()
        real = torch.arange(n, device=tokens.device)[None, :] < torch.tensor(counts, device=tokens.device)[:, None]
        block_aux[:, :n][real] = aux[real]  # row b: its counts[b] pairs, then the placeholders
        block_tokens[:, :n][real] = tokens[real]
        out = self.rows(self.project(block_aux), block_tokens, self.lengths, [c + k - 1 for c in counts])
        self.rows.commit(counts)
        self.rows_pending = None
        at = torch.tensor(counts, device=out.device)[:, None] - 1 + torch.arange(k, device=out.device)[None, :]
        return self._logits(out.gather(1, at[..., None].expand(-1, -1, out.shape[-1])))  # [B, k, V_d]

    @torch.no_grad()
    def propose_batch(self, budgets: list[int]) -> list[torch.Tensor]:
        drafts = self.to_target(self._round_rows(max(budgets)).argmax(-1))
        return [drafts[b, :k] for b, k in enumerate(budgets)]

    @torch.no_grad()
    def propose_sampled_batch(self, budgets: list[int], sampling, generator: torch.Generator | None = None):
        """Each row's depths sampled from their warped distributions: per row (tokens [k_b], q [k_b, V])."""
        q_draft = sampling.probs(self._round_rows(max(budgets)))  # [B, k, V_d]
        B, k, V_d = q_draft.shape
        drafts = torch.multinomial(q_draft.reshape(B * k, V_d), 1, generator=generator).view(B, k)
        q, drafts = self.on_target_vocab(q_draft), self.to_target(drafts)
        return [drafts[b, :n] for b, n in enumerate(budgets)], [q[b, :n] for b, n in enumerate(budgets)]

    def select(self, rows: list[int]) -> None:
        self.rows.select(rows)
        if self.rows_pending is not None:
            aux, tokens, counts = self.rows_pending
            index = torch.tensor(rows, dtype=torch.long, device=self.device)
            self.rows_pending = (aux[index], tokens[index], [counts[r] for r in rows])
