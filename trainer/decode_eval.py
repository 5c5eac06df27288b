"""Integrated evaluation: decode a few held-out prompts speculatively with the head being trained.

Training accuracy says how often step i's argmax is right on the teacher-forced data; tau (tokens
per target forward) is what a server gets. This runs the real decoder (decode/) on the target and a
copy of the head loaded with the current weights, greedy, and reports tau.

With a replicated target only rank 0 decodes. With a sharded target (FSDP ``shard_target``) every
forward is collective, so every rank decodes the same prompts in lockstep with the same weights.
"""

from __future__ import annotations

import copy

import datasets
import torch
import torch.distributed as dist
from torch import nn

from headstart.heads.registry import drafter_for
from headstart.decode.measure import decode_tau
from headstart.decode.target_runner import TargetRunner
from headstart.models.target import Target
from headstart.trainer.distributed import DistInfo


def held_out_prompts(eval_data: datasets.Dataset, n: int) -> list[torch.Tensor]:
    """The chat prefix of the first n held-out rows: everything before the first trained token."""
    prompts = []
    for row in eval_data.select(range(min(n, len(eval_data)))):
        mask = row["loss_mask"]
        if 1 in mask and mask.index(1) > 0:
            prompts.append(torch.tensor([row["input_ids"][: mask.index(1)]]))
    return prompts


class DecodeEval:
    def __init__(self, target: Target, head: nn.Module, eval_data: datasets.Dataset, prompts: int,
                 max_new_tokens: int, k: int, eos_ids: set[int], info: DistInfo, collective: bool) -> None:
        self.target, self.info, self.collective = target, info, collective
        self.max_new_tokens, self.k, self.eos_ids = max_new_tokens, k, eos_ids
        self.prompts = held_out_prompts(eval_data, prompts)
        if not self.prompts:
            raise ValueError("train.decode_eval_prompts > 0 but no held-out row has a prompt before its first trained token")
        # A plain copy of the head (before any FSDP/DeepSpeed wrapping) that receives the current weights.
        self.head = copy.deepcopy(head).to(info.device) if (info.is_main or collective) else None
        if self.head is not None:
            drafter_for(self.head, 1)  # refuse a head no drafter reads now, not at the first evaluation
        self.max_len = max(p.shape[1] for p in self.prompts) + max_new_tokens + k + 2
        self.with_aux = type(head).needs.aux_hidden_states  # the runner builds aux states only for heads that read them

    @torch.no_grad()
    def __call__(self, state: dict[str, torch.Tensor] | None) -> dict[str, float] | None:
        """``state``: the head's full state dict on rank 0 (None elsewhere). Returns metrics on rank 0."""
        if self.collective and self.info.world_size > 1:
            box = [state]
            dist.broadcast_object_list(box, src=0)
            state = box[0]
        elif not self.info.is_main:
            return None
        missing = [n for n, p in self.head.named_parameters() if p.requires_grad and n not in state]
        if missing:
            raise KeyError(f"decode evaluation: the gathered head state lacks trained weights {missing[:3]}")
        # strict=False: a backend may leave frozen tensors (the target's embeddings) out of its gathered state.
        self.head.load_state_dict({k: v.to(self.info.device) for k, v in state.items()}, strict=False)
        self.head.eval()
        runner = TargetRunner(self.target, self.max_len, with_aux=self.with_aux)
        tally = decode_tau(runner, lambda: drafter_for(self.head, self.max_len), self.prompts, self.max_new_tokens,
                           self.eos_ids, self.k)
        return {"decode_tau": tally.summary()["tau"], "decode_tokens": float(tally.tokens)} if self.info.is_main else None
