"""Online speculative decoding (Liu et al., ICML 2024): a head that keeps learning from the requests it serves.

Every verification forward already computes what a head trains on: the target's hidden states at the served tokens
(the aux states EAGLE-3-style heads read, the final state Medusa and MTP read) and, from the final state, its logits.
``OnlineDrafter`` wraps a head's drafter and keeps those states as the loop hands them over (``begin``: the prompt's,
``update``: each round's, ``finish``: the last round's), nothing recomputed by the target; a finished request goes into
a ``ReplayBuffer`` bounded in tokens. Every ``every`` served requests ``OnlineLearner`` takes ``steps`` optimizer steps
on the buffer: the head's own ``loss`` on ``Features`` built by the trainer's ``OnlineFeatures.from_states`` (the
teacher's logits projected from the stored final states at the trained positions, as training does), through the
trainer's single-process backend (clip, AdamW or Muon) -- then the next request drafts with the new weights. With
``Replay`` every step also takes as many rows of the head's original data (their features from a target forward, as
online training computes them): served traffic of one domain alone makes a head forget the others.

The output stays exactly the target's: the drafts change, verification does not (greedy: the target's argmax; sampled:
rejection sampling against q, whatever weights drew it). The update's time lands in the loop's ``learn`` part, inside
the timed decode, so a measured speed-up pays for it.
"""

from __future__ import annotations

import copy
import random
from collections import deque
from dataclasses import dataclass, replace

import datasets
import torch
from torch import nn

from headstart.decode.drafter import Drafter
from headstart.models.export import export_head
from headstart.models.head import Features
from headstart.models.target import Target, TargetOutput
from headstart.trainer.batches import collate
from headstart.trainer.config import TrainConfig
from headstart.trainer.distributed import DistInfo, FSDPBackend
from headstart.trainer.features import OnlineFeatures
from headstart.trainer.loop import autocast_context


@dataclass(frozen=True)
class OnlineSchedule:
    """When and how much the head learns (``--online-every``, ``--online-steps``, ``--online-buffer``)."""

    every: int = 4
    """Served requests between two updates."""
    steps: int = 4
    """Optimizer steps per update."""
    buffer_tokens: int = 8192
    """The replay buffer's size in served tokens (prompt and reply); the oldest requests leave first."""

    def __post_init__(self) -> None:
        for name in ("every", "steps", "buffer_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--online-{name.split('_')[0]} must be >= 1, got {getattr(self, name)}")


@dataclass
class Served:
    """One served request: its tokens (prompt, then reply) and the target's states at every position but the last (the
    last token was never fed to the target: nothing follows it)."""

    input_ids: torch.Tensor  # [T] int64
    prompt_length: int
    states: TargetOutput  # [1, T - 1, ...]

    @property
    def tokens(self) -> int:
        return int(self.input_ids.numel())


class ReplayBuffer:
    """The latest served requests, at most ``capacity`` tokens in all (one request alone may exceed it: it is kept)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.requests: deque[Served] = deque()
        self.tokens = 0

    def add(self, request: Served) -> None:
        self.requests.append(request)
        self.tokens += request.tokens
        while self.tokens > self.capacity and len(self.requests) > 1:
            self.tokens -= self.requests.popleft().tokens

    def clear(self) -> None:
        self.requests.clear()
        self.tokens = 0

    def __len__(self) -> int:
        return len(self.requests)


def pad_requests(requests: list[Served], needs_aux: bool) -> tuple[torch.Tensor, torch.Tensor, TargetOutput]:
    """A micro-batch of served requests, right-padded: (input_ids [B, T], loss_mask [B, T]: 1 on each reply's tokens,
    states [B, T, ...]: zeros at the last token and the padding, where no trained position reads them)."""
    T = max(r.tokens for r in requests)
    first = requests[0].states
    device = first.last_hidden_state.device
    ids = torch.zeros(len(requests), T, dtype=torch.long, device=device)
    mask = torch.zeros(len(requests), T, dtype=torch.long, device=device)
    last = first.last_hidden_state.new_zeros(len(requests), T, first.last_hidden_state.shape[-1])
    aux = first.aux_hidden_states.new_zeros(len(requests), T, first.aux_hidden_states.shape[-1]) if needs_aux else None
    for b, r in enumerate(requests):
        n = r.tokens
        ids[b, :n] = r.input_ids
        mask[b, r.prompt_length : n] = 1
        last[b, : n - 1] = r.states.last_hidden_state[0]
        if aux is not None:
            aux[b, : n - 1] = r.states.aux_hidden_states[0]
    return ids, mask, TargetOutput(aux_hidden_states=aux, last_hidden_state=last)


class Replay:
    """The head's original conversations, tokenized as training tokenizes them (``build_dataset``), drawn a micro-batch
    at a time against forgetting; their features from the target's own forward (``OnlineFeatures``)."""

    def __init__(self, dataset: datasets.Dataset, seed: int = 0) -> None:
        if len(dataset) == 0:
            raise ValueError("--online-replay: no conversations to replay")
        self.dataset, self.rng = dataset, random.Random(seed)

    def draw(self, rows: int, features: OnlineFeatures) -> Features:
        batch = collate(self.dataset, self.rng.sample(range(len(self.dataset)), min(rows, len(self.dataset))))
        return features(batch)


class OnlineLearner:
    """Trains ``head`` (the one the drafters read) on what it serves. A float32 head learns in place; a lower-precision
    one (bf16 on a GPU) through a float32 copy whose trained weights are copied into it after each update."""

    def __init__(self, head: nn.Module, target: Target, schedule: OnlineSchedule, train: TrainConfig | None = None,
                 replay: Replay | None = None) -> None:
        self.serving, self.target, self.schedule, self.replay = head, target, schedule, replay
        # Online there is no run length for a schedule to decay over: the recipe's optimizer at a constant rate. A step
        # with replay is two micro-batches (served, replayed) of equal weight.
        self.train_config = replace(train or TrainConfig(), schedule="constant", warmup_ratio=0.0,
                                    grad_accum=2 if replay else 1)
        self.device = next(head.parameters()).device
        self.in_place = all(p.dtype == torch.float32 for p in head.parameters())
        self.head = head if self.in_place else copy.deepcopy(head).float()
        self.initial = {n: p.detach().clone() for n, p in self.head.named_parameters() if p.requires_grad}
        self.features = OnlineFeatures(target, head.needs, head.target_vocab_ids().to(self.device))
        self.buffer = ReplayBuffer(schedule.buffer_tokens)
        self.forget()

    def forget(self) -> None:
        """Back to the head it started from: its weights, a fresh optimizer, an empty buffer (the benchmark's untimed
        warm-up decode teaches nothing)."""
        with torch.no_grad():
            for name, p in self.head.named_parameters():
                if name in self.initial:
                    p.copy_(self.initial[name])
            self._publish()
        info = DistInfo(rank=0, world_size=1, local_rank=0, device=self.device)
        self.backend = FSDPBackend(self.head, self.train_config, info)
        self.buffer.clear()
        self.served = 0
        self.updates = 0
        self.rng = random.Random(self.train_config.seed)
        self.last_loss: float | None = None

    def drafter(self, inner: Drafter) -> OnlineDrafter:
        """``inner``, recording what it serves for this learner."""
        return OnlineDrafter(inner, self)

    def add(self, request: Served) -> None:
        """A finished request: into the buffer; every ``every``-th, an update."""
        self.buffer.add(request)
        self.served += 1
        if self.served % self.schedule.every == 0:
            self.learn()

    def learn(self) -> None:
        """``steps`` optimizer steps, each on ``train.batch_size`` requests drawn from the buffer (and as many replayed
        conversations)."""
        needs_aux = bool(self.head.needs.aux_hidden_states)
        size = self.train_config.batch_size
        self.head.train()
        with torch.enable_grad():
            for _ in range(self.schedule.steps):
                batch = self.rng.sample(list(self.buffer.requests), min(size, len(self.buffer)))
                ids, mask, states = pad_requests(batch, needs_aux)
                micro = [self.features.from_states(ids, mask, states)]
                if self.replay is not None:
                    micro.append(self.replay.draw(size, self.features))
                for i, features in enumerate(micro):
                    with autocast_context(self.train_config.mixed_precision, self.device):
                        loss, _ = self.backend.forward(features)
                    self.backend.backward(loss, last_micro=i == len(micro) - 1)
                    if i == 0:
                        self.last_loss = float(loss.detach())
                self.backend.step()
        self.head.eval()
        with torch.no_grad():
            self._publish()
        self.updates += 1

    def _publish(self) -> None:
        """The trained weights into the head the drafters read (nothing to do when that is the trained head)."""
        if self.in_place:
            return
        trained = dict(self.head.named_parameters())
        for name, p in self.serving.named_parameters():
            if trained[name].requires_grad:
                p.copy_(trained[name])

    def export(self, directory: str, name: str, target_fingerprint: dict | None) -> None:
        """The head as it has learned so far, exported like a trained one (its first layout), for ``check_head``, a
        server, or the next run's ``--draft``."""
        export_head(self.head, directory, name, target_fingerprint)

    def describe(self) -> str:
        s = self.schedule
        replay = f", {len(self.replay.dataset)} conversations replayed" if self.replay else ""
        return (f"online: {s.steps} step(s) at lr {self.train_config.lr:g} every {s.every} request(s), buffer "
                f"{s.buffer_tokens} tokens{replay}, "
                f"{self.updates} update(s) over {self.served} request(s)")


class OnlineDrafter:
    """A drafter for one sequence that records the request it serves for an ``OnlineLearner``: everything else is the
    wrapped drafter's (its capabilities included)."""

    def __init__(self, inner: Drafter, learner: OnlineLearner) -> None:
        self.inner, self.learner = inner, learner
        self.ids: list[int] = []
        self.states: list[TargetOutput] = []
        self.prompt_length = 0

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def begin(self, prompt_ids: torch.Tensor, states: TargetOutput, next_token: int) -> None:
        self.ids = prompt_ids[0].tolist() + [next_token]
        self.prompt_length = prompt_ids.shape[1]
        self.states = [states]
        self.inner.begin(prompt_ids, states, next_token)

    def update(self, emitted: list[int], states: TargetOutput) -> None:
        self.ids += emitted
        self.states.append(states)
        self.inner.update(emitted, states)

    def finish(self, emitted: list[int], states: TargetOutput) -> None:
        self.ids += emitted
        self.states.append(states)
        self.inner.finish(emitted, states)
        ids = torch.tensor(self.ids, device=states.last_hidden_state.device)
        self.learner.add(Served(ids, self.prompt_length, TargetOutput.cat(self.states)))
        self.states = []
