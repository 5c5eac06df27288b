"""Run configuration: frozen dataclasses per component, loaded from YAML, overridable from the CLI.

    python scripts/train_eagle3.py --config configs/demo/eagle3.yaml --train.lr=3e-4 --output_dir=runs/x

Each component receives only its own sub-config. An unknown key, in the file or an override, is
an error that lists the valid keys: a typo never silently trains with the default.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from headstart.models.head import DEFAULT_SPECULATIVE_TOKENS, DraftConfig
from headstart.heads.registry import draft_fields, split_draft_section
from headstart.models.target import TargetConfig
from headstart.trainer.data import DataConfig


@dataclass(frozen=True)
class TrainConfig:
    lr: float = 1e-4
    max_steps: int = 1000
    """Optimizer steps."""
    batch_size: int = 1
    """Sequences per rank per micro-batch, on average. The global batch is batch_size x ranks x grad_accum,
    dealt to ranks and micro-batches by each sequence's work (tokens + trained tokens) so that no rank waits for
    another (trainer/batches.py); a run resumed on another world size trains on the same rows step for step when it
    keeps the global batch."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    warmup_ratio: float = 0.015
    """Share of max_steps with linear warm-up; then ``schedule`` decays the rate."""
    schedule: str = "linear"
    """After warm-up: linear (to 0; it won the demo recipe's ablation), cosine (to 0) or constant."""
    optimizer: str = "adamw"
    """adamw, or muon: torch.optim.Muon for the head's hidden matrices (AdamW for norms, embeddings and lm_head),
    its update scaled to AdamW's RMS so ``lr`` means the same for both. The FSDP backend (any world size)."""
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    grad_clip: float = 0.5
    """Gradient-norm clipping."""
    seed: int = 0
    """Seeds the held-out split, the row order of every epoch and the head's initialisation."""
    save_every: int = 500
    """Steps between checkpoints (a final one is always written)."""
    keep_checkpoints: int = 2
    """Checkpoints kept under output_dir/checkpoints/ (the newest; older ones are deleted once a newer is whole)."""
    eval_every: int = 0
    """Steps between held-out evaluations; 0 evaluates only at the end. Every evaluation that beats the
    earlier ones (decode tau with decode_eval_prompts, else the simulated acceptance length) is exported
    to output_dir/best/."""
    eval_fraction: float = 0.02
    """Share of the rows held out for evaluation (at least one row when > 0)."""
    max_eval_batches: int = 50
    log_every: int = 10
    """Steps between the train rows of metrics.jsonl / wandb (and the last step). Only those steps compute the
    metrics that cost a pass over the logits (top-5, sum min(p, q)); the progress bar shows every step's loss."""
    decode_eval_prompts: int = 0
    """Held-out prompts decoded speculatively (greedy chain) at every evaluation to log tau; 0 = off."""
    decode_eval_max_new_tokens: int = 64
    decode_eval_k: int = DEFAULT_SPECULATIVE_TOKENS
    mixed_precision: str = "auto"
    """auto (bf16 autocast on GPU, fp32 on CPU) | bf16 | fp32."""
    prefetch: bool = False
    """Compute the next micro-batch's features (the target's forward, or the store's read) on a worker thread while
    the head trains on this one (trainer/prefetch.py). Peak memory grows by the target's forward (activations and
    features) of one micro-batch during the head's backward. Not with a sharded target on several ranks (a warning;
    the run goes on without it)."""
    compile: bool = False
    """The head's pure tensor parts (each head's ``compiled``) through torch.compile, dynamic shapes: fewer, fused
    kernels where a GPU step is launch-bound; no gain on a CPU. The FSDP backend (models/train_compile.py)."""


@dataclass(frozen=True)
class ParallelConfig:
    backend: str = "fsdp"
    """fsdp (FSDP2 fully_shard) | deepspeed."""
    deepspeed_config: str = "configs/deepspeed/zero2.json"
    """DeepSpeed JSON (ZeRO stage and its options); batch, accumulation and clipping come from train."""
    shard_target: bool = False
    """FSDP only: shard the frozen target's layers across ranks instead of replicating it."""


@dataclass(frozen=True)
class LoggingConfig:
    wandb: bool = False
    project: str = "headstart"
    run_name: str | None = None
    progress: bool = True
    """Rank-0 tqdm progress bar."""


@dataclass(frozen=True)
class FeaturesConfig:
    """The offline feature store (trainer/feature_store.py). With ``path`` set, training reads the
    stored features instead of running the target; scripts/generate_features.py writes them there."""

    path: str | None = None
    aux: str = "fp8"
    """Aux hidden states on disk: fp8 (e4m3, a bf16 scale per token and layer) | bf16 (lossless for a bf16 target)."""
    target_dist: str = "topk"
    """EAGLE-3's target distribution on disk: topk (top-k probabilities over the full vocab) | hidden (final hidden state)."""
    hidden: str = "bf16"
    """The final hidden state on disk, when stored (Medusa, MTP, target_dist=hidden): bf16 (lossless for a bf16
    target) | fp8 (e4m3, a bf16 scale per token)."""
    topk: int = 32
    samples_per_shard: int = 256
    batch_size: int = 4
    """Sequences per target forward while generating."""


@dataclass(frozen=True)
class ExportConfig:
    format: str = "default"
    """The head's checkpoint layout: default (its first) | one of its layouts (EAGLE-3: flat | speculators)
    | both (the first in the run's directory, the others in subdirectories named after them)."""


@dataclass(frozen=True)
class RunConfig:
    output_dir: str = "runs/eagle3"
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    draft: DraftConfig = field(default_factory=lambda: _build_draft({}, "draft."))
    """Flat in a recipe (``draft: {head: medusa, num_heads: 4}``): the shared fields and the head's own options."""
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    export: ExportConfig = field(default_factory=ExportConfig)


AT_LEAST: dict[type, dict[str, float]] = {
    TrainConfig: {"max_steps": 1, "batch_size": 1, "grad_accum": 1, "save_every": 1, "keep_checkpoints": 1,
                  "eval_every": 0, "eval_fraction": 0, "max_eval_batches": 1, "log_every": 1, "decode_eval_prompts": 0,
                  "decode_eval_max_new_tokens": 1, "decode_eval_k": 1, "warmup_ratio": 0, "lr": 0, "grad_clip": 0},
    FeaturesConfig: {"topk": 1, "samples_per_shard": 1, "batch_size": 1},
    DataConfig: {"max_length": 1, "num_proc": 1},
}
"""The least value of each numeric field that has one, checked as a recipe is read: ``train.max_steps: 0`` would
export an untrained head, ``train.save_every: 0`` divide by zero, ``train.batch_size: 0`` build no batch."""


def _check_bounds(cls: type, values: dict[str, Any], where: str) -> None:
    for name, least in AT_LEAST.get(cls, {}).items():
        value = values.get(name)
        if isinstance(value, (int, float)) and value < least:
            raise ValueError(f"{where}{name}={value}: must be >= {least:g}; fix the recipe or the --{where}{name}= override")


def _build(cls: type, values: dict[str, Any], where: str):
    if not isinstance(values, dict):
        raise ValueError(f"{where or 'config'}: expected a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"unknown config key(s) {[f'{where}{k}' for k in unknown]}; valid keys here: {sorted(names)}")
    kwargs = {}
    for name, value in values.items():
        kwargs[name] = _coerce(hints[name], value, f"{where}{name}")
    _check_bounds(cls, kwargs, where)
    return cls(**kwargs)


def _build_draft(values: dict[str, Any], where: str) -> DraftConfig:
    """The flat draft section: the head's own fields go to its options dataclass (heads/registry.py)."""
    if not isinstance(values, dict):
        raise ValueError(f"{where.rstrip('.')}: expected a mapping, got {values!r}")
    spec, shared, own = split_draft_section(values, where)
    return dataclasses.replace(_build(DraftConfig, shared, where), options=_build(spec.options, own, where))


def _coerce(tp, value, key: str):
    origin = typing.get_origin(tp)
    if tp is DraftConfig:
        return _build_draft(value or {}, key + ".")
    if dataclasses.is_dataclass(tp):
        return _build(tp, value or {}, key + ".")
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(args[0], value, key)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        item = args[0] if len(args) == 2 and args[1] is Ellipsis else None
        return tuple(_coerce(item or args[i], v, key) for i, v in enumerate(value))
    if tp is float and not isinstance(value, bool) and isinstance(value, (int, str)):
        try:  # YAML 1.1 reads "3e-4" (no dot) as a string
            return float(value)
        except ValueError:
            raise ValueError(f"{key}: expected a number, got {value!r}") from None
    if tp in (int, float, str, bool) and not isinstance(value, tp):
        raise ValueError(f"{key}: expected {tp.__name__}, got {value!r}")
    return value


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ValueError(f"override --{dotted}: {p} is not a section")
    node[leaf] = value


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``--train.lr=3e-4`` / ``--train.lr 3e-4`` pairs -> nested dict (values parsed as YAML)."""
    tree: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument {arg!r}; overrides look like --section.key=value")
        if "=" in arg:
            key, raw = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ValueError(f"override {arg} has no value")
            key, raw = arg[2:], args[i + 1]
            i += 2
        _set_dotted(tree, key, yaml.safe_load(raw))
    return tree


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(path: str | None, overrides: list[str] | None = None) -> RunConfig:
    """YAML file (optional) + CLI overrides -> RunConfig."""
    tree: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        tree = yaml.safe_load(p.read_text()) or {}
    tree = _merge(tree, parse_overrides(overrides or []))
    return _build(RunConfig, tree, "")  # unknown keys are refused here, by section (the draft's by head)


def to_dict(config: RunConfig) -> dict[str, Any]:
    """The config as a recipe writes it (the draft section flat)."""
    return {**dataclasses.asdict(config), "draft": draft_fields(config.draft)}
