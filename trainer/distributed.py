"""Process groups and the two training backends, FSDP2 and DeepSpeed, behind one small interface.

The loop only calls ``backward``, ``step``, ``save``, ``load`` and ``full_state_dict``, so it has no
backend branches. Parallelism is applied to built modules from outside (``apply_fsdp``).
"""

from __future__ import annotations

import datetime
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from headstart.trainer.config import ParallelConfig, TrainConfig
from headstart.trainer.muon import GatheredMuon


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> DistInfo:
    """torchrun sets RANK/WORLD_SIZE; a plain ``python`` run is world size 1 with no process group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        # Long timeout: the other ranks wait at a barrier while rank 0 tokenizes a large dataset.
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(hours=2))
    return DistInfo(rank, world, local_rank, device)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(x)
    return x


def apply_fsdp(module: nn.Module, blocks: list[nn.Module] | None = None) -> nn.Module:
    """FSDP2: shard each block, then the root (what is left: embeddings, heads, norms)."""
    from torch.distributed.fsdp import fully_shard

    for block in blocks or []:
        fully_shard(block)
    fully_shard(module)
    return module


def shard_frozen_layers(layers: list[nn.Module]) -> None:
    """FSDP2 on a frozen model's decoder layers only: each layer's forward gathers its weights.

    The embeddings, final norm and lm_head stay replicated, because the target wrapper reads them
    outside the root's forward (lm_head restricted to the draft vocab); they are a small share."""
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer, reshard_after_forward=True)


SCHEDULES = {
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
    "linear": lambda progress: 1.0 - progress,
    "constant": lambda progress: 1.0,
}


def lr_lambda(train: TrainConfig):
    if train.schedule not in SCHEDULES:
        raise ValueError(f"train.schedule={train.schedule!r}: expected one of {', '.join(SCHEDULES)}")
    warmup = max(1, int(train.warmup_ratio * train.max_steps))
    decay = SCHEDULES[train.schedule]

    def f(step: int) -> float:  # linear warmup, then the schedule's decay
        if step < warmup:
            return (step + 1) / warmup
        return decay(min(1.0, (step - warmup) / max(1, train.max_steps - warmup)))

    return f


ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def _optimizers(module: nn.Module, train: TrainConfig) -> list[torch.optim.Optimizer]:
    """AdamW over every trainable parameter, or (``train.optimizer=muon``) Muon over the hidden matrices and AdamW
    over the rest (norms, embeddings, lm_head and other token tables: Muon's orthogonalised update is for hidden layers'
    matrices)."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    adamw = lambda params: torch.optim.AdamW(params, lr=train.lr, betas=train.betas, weight_decay=train.weight_decay)  # noqa: E731
    if train.optimizer == "adamw":
        return [adamw([p for _, p in named])]
    if train.optimizer != "muon":
        raise ValueError(f"train.optimizer={train.optimizer!r}: expected adamw or muon")
    # Under FSDP2 the matrices are DTensors sharded by rows: GatheredMuon orthogonalises each whole matrix once per
    # step and every rank applies the full-matrix update to its shard (tests/test_distributed.py: 2 ranks follow
    # 1 process); on one process it is torch's Muon step for step.
    # Token tables stay with AdamW: embeddings (by module type or name), the lm_head, and any matrix with a side the
    # size of an embedding's vocab (DSpark's Markov head, DFlash2's codebooks: looked up or projected per token); so do
    # vectors stored as matrices (a [1, n] scoring row such as DSpark's confidence head: nothing to orthogonalise).
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    tables, vocabs = {id(m.weight) for m in embeddings}, {m.num_embeddings for m in embeddings}
    hidden = [p for n, p in named if p.ndim == 2 and "embed" not in n and "lm_head" not in n and id(p) not in tables
              and not vocabs & set(p.shape) and min(p.shape) > 1]
    ids = {id(p) for p in hidden}
    muon = GatheredMuon(hidden, lr=train.lr, weight_decay=train.weight_decay, adjust_lr_fn="match_rms_adamw")
    return [muon, adamw([p for _, p in named if id(p) not in ids])]


class FSDPBackend:
    """FSDP2 on the head when world size > 1; the same code unwrapped on a single process."""

    def __init__(self, head: nn.Module, train: TrainConfig, info: DistInfo) -> None:
        self.train, self.info = train, info
        self.module = head.to(info.device)
        if info.world_size > 1:
            apply_fsdp(self.module)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizers = _optimizers(self.module, train)
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(train)) for o in self.optimizers]
        # DCP's state-dict helpers take one optimizer or several; one keeps the checkpoint layout AdamW always had.
        self.optimizer = self.optimizers[0] if len(self.optimizers) == 1 else self.optimizers

    def forward(self, features):
        return self.module(features)

    def backward(self, loss: torch.Tensor, last_micro: bool) -> None:
        if self.info.world_size > 1:
            self.module.set_requires_gradient_sync(last_micro)  # reduce-scatter once per step
        (loss / self.train.grad_accum).backward()

    def step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.train.grad_clip)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        for optimizer, scheduler in zip(self.optimizers, self.schedulers):
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        return float(norm)

    @property
    def lr(self) -> float:
        return self.schedulers[0].get_last_lr()[0]

    def _state_dicts(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=self.info.world_size > 1)
        return get_state_dict(self.module, self.optimizer, options=options)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole head's state on rank 0 (None elsewhere); collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=self.info.world_size > 1)
        state = get_model_state_dict(self.module, options=options)
        return {k: v.detach().cpu() for k, v in state.items()} if self.info.is_main else None

    def save(self, directory: Path) -> None:
        """Model, optimizer and schedule in safetensors + JSON; frozen weights are not saved."""
        model_sd, optim_sd = self._state_dicts()
        if not self.info.is_main:
            return
        trainable = {n for n, p in self.module.named_parameters() if p.requires_grad}
        buffers = {n for n, _ in self.module.named_buffers()}
        save_file({k: v.contiguous() for k, v in model_sd.items() if k in trainable | buffers}, str(directory / "model.safetensors"))
        tensors = {f"{fqn}/{key}": torch.as_tensor(v).contiguous()
                   for fqn, state in optim_sd["state"].items() for key, v in state.items()}
        save_file(tensors, str(directory / "optimizer.safetensors"))
        groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in optim_sd["param_groups"]]
        sched = {k: v for k, v in self.schedulers[0].state_dict().items() if k != "lr_lambdas"}  # all in step
        (directory / "optimizer.json").write_text(json.dumps({"param_groups": groups, "scheduler": sched}))

    def load(self, directory: Path, written_by: int) -> None:
        """``written_by``: the world size that saved it. The files hold full (unsharded) tensors, so
        any world size loads them: ``set_state_dict`` shards them onto this run's FSDP mesh."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        model_sd = load_file(str(directory / "model.safetensors"))
        flat = load_file(str(directory / "optimizer.safetensors"))
        meta = json.loads((directory / "optimizer.json").read_text())
        state: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in flat.items():
            fqn, key = name.rsplit("/", 1)
            state.setdefault(fqn, {})[key] = tensor
        optim_sd = {"state": state, "param_groups": meta["param_groups"]}
        options = StateDictOptions(full_state_dict=True, strict=False)
        set_state_dict(self.module, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
        for scheduler in self.schedulers:
            scheduler.load_state_dict({**meta["scheduler"], "lr_lambdas": [None]})


class DeepSpeedBackend:
    """DeepSpeed ZeRO-2/3 from a JSON file; batch, accumulation and clipping come from ``train``."""

    def __init__(self, head: nn.Module, train: TrainConfig, parallel: ParallelConfig, info: DistInfo) -> None:
        try:
            import deepspeed
        except ImportError as err:
            raise ImportError("parallel.backend=deepspeed needs DeepSpeed: pip install -e '.[deepspeed]'") from err
        path = Path(parallel.deepspeed_config)
        if not path.is_file():
            raise FileNotFoundError(f"DeepSpeed config not found: {path}")
        ds_config = json.loads(path.read_text())
        ds_config.update(
            train_micro_batch_size_per_gpu=train.batch_size,
            gradient_accumulation_steps=train.grad_accum,
            train_batch_size=train.batch_size * train.grad_accum * info.world_size,
            gradient_clipping=train.grad_clip,
            steps_per_print=10**9,
        )
        self.train, self.info = train, info
        self.zero_stage = ds_config.get("zero_optimization", {}).get("stage", 0)
        if self.zero_stage not in (1, 2, 3):
            raise ValueError(f"{path}: zero_optimization.stage must be 1, 2 or 3 (got {self.zero_stage}); without ZeRO "
                             "use parallel.backend=fsdp")
        head = head.to(info.device)
        if train.optimizer != "adamw":
            raise ValueError(f"train.optimizer={train.optimizer!r}: the DeepSpeed backend trains with adamw (ZeRO "
                             "partitions the matrices Muon orthogonalises); use parallel.backend=fsdp on one process")
        (optimizer,) = _optimizers(head, train)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(train))
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=head, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
        )
        self.module = self.engine.module

    def forward(self, features):
        return self.engine(features)

    def backward(self, loss: torch.Tensor, last_micro: bool) -> None:
        # DeepSpeed divides by the accumulation steps itself and steps at the boundary.
        self.engine.backward(loss)
        self.engine.step()

    def step(self) -> float:
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        if self.zero_stage == 3:
            state = self.engine._zero3_consolidated_16bit_state_dict()  # gathered on rank 0 only
        else:
            state = self.engine.module.state_dict()
        return {k: v.detach().cpu() for k, v in state.items()} if self.info.is_main and state is not None else None

    def save(self, directory: Path) -> None:
        """DeepSpeed's own partitioned checkpoint (exact resume on the same world size), plus the full fp32
        weights and Adam moments gathered through DeepSpeed's tensor-fragment API (``portable.*``): what a
        resume on another world size reads. DeepSpeed's universal-checkpoint converter needs Megatron-style
        client metadata (UNIVERSAL_CHECKPOINT_INFO) and elastic checkpoints do not cover ZeRO-3; a draft head
        is small enough to gather whole."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        self.engine.save_checkpoint(str(directory), tag="deepspeed", save_latest=False)
        tensors = {}
        for name, p in self._trained():  # collective under ZeRO-3: every rank, the same order
            for key, value in (("param", safe_get_full_fp32_param(p)), *((k, safe_get_full_optimizer_state(p, k))
                                                                        for k in ADAM_MOMENTS)):
                tensors[f"{name}/{key}"] = value.detach().float().cpu().contiguous()
        if self.info.is_main:
            save_file(tensors, str(directory / "portable.safetensors"))
            sched = {k: v for k, v in self.scheduler.state_dict().items() if k != "lr_lambdas"}
            (directory / "portable.json").write_text(json.dumps({"adam_step": self._adam_step(), "scheduler": sched}))

    def load(self, directory: Path, written_by: int) -> None:
        if written_by == self.info.world_size:
            self.engine.load_checkpoint(str(directory), tag="deepspeed", load_optimizer_states=True,
                                        load_lr_scheduler_states=True)
            return
        self._load_portable(directory)

    def _load_portable(self, directory: Path) -> None:
        """Another world size: the gathered fp32 weights and moments go into this run's partitions."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        if not (directory / "portable.safetensors").is_file():
            raise ValueError(f"{directory} has no portable.safetensors (written by headstart < 0.3): it resumes only on "
                             "the world size that wrote it")
        tensors = load_file(str(directory / "portable.safetensors"))
        meta = json.loads((directory / "portable.json").read_text())
        zero = self.engine.optimizer
        # Adam creates its state at the first step; the fragment API writes into it, so create it first
        # (zeros, and the step count that Adam's bias correction reads) on this rank's fp32 partitions.
        flats = getattr(zero, "single_partition_of_fp32_groups", None) or zero.fp32_partitioned_groups_flat
        for flat in flats:
            zero.optimizer.state[flat] = {"step": torch.tensor(float(meta["adam_step"])),
                                          **{k: torch.zeros_like(flat) for k in ADAM_MOMENTS}}
        if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-1/2 link fragments to that state lazily
            zero._hp_optimizer_states_linked = False
            zero._lazy_init_hp_params_optimizer_state()
        for name, p in self._trained():
            safe_set_full_fp32_param(p, tensors[f"{name}/param"].to(p.device))
            for key in ADAM_MOMENTS:
                safe_set_full_optimizer_state(p, tensors[f"{name}/{key}"].to(p.device), key)
        # The model's own (low-precision) copies follow the fp32 master partitions.
        if hasattr(zero, "update_lp_params"):  # ZeRO-1/2
            zero.update_lp_params()
        else:  # ZeRO-3
            for lp, hp in zip(zero.fp16_partitioned_groups_flat, zero.fp32_partitioned_groups_flat):
                if hp.numel():
                    lp.data.copy_(hp.data)
        self.scheduler.load_state_dict({**meta["scheduler"], "lr_lambdas": [None]})
        for group, lr in zip(zero.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr  # load_state_dict restores the schedule's position, not the rate it last set

    def _trained(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.engine.module.named_parameters() if p.requires_grad]

    def _adam_step(self) -> float:
        steps = [float(s["step"]) for s in self.engine.optimizer.optimizer.state.values() if "step" in s]
        return max(steps, default=0.0)


def make_backend(head: nn.Module, train: TrainConfig, parallel: ParallelConfig, info: DistInfo):
    if parallel.backend == "fsdp":
        return FSDPBackend(head, train, info)
    if parallel.backend == "deepspeed":
        return DeepSpeedBackend(head, train, parallel, info)
    raise ValueError(f"unknown parallel.backend {parallel.backend!r}; use 'fsdp' or 'deepspeed'")
