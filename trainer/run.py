"""Build a training run from a RunConfig: data, target, head, backend, features, loop."""

from __future__ import annotations

import json
import os
import socket
from dataclasses import replace
from pathlib import Path

import datasets
import torch
from safetensors.torch import load_file, save_file

from headstart.models.draft_vocab import count_tokens
from headstart.models.export import export_head, layouts_for
from headstart.models.files import share_like_umask
from headstart.models.provenance import check_target, fingerprint
from headstart.heads.exports import check_readable
from headstart.heads.registry import build_head
from headstart.models.target import Target, dtype_of, load_tokenizer
from headstart.models.target_matrices import TargetMatrices
from headstart.models.train_compile import compile_parts
from headstart.trainer.batches import split_eval
from headstart.trainer.config import RunConfig, to_dict
from headstart.trainer.data import build_dataset, default_cache_dir
from headstart.trainer.decode_eval import DecodeEval
from headstart.trainer.distributed import DistInfo, barrier, init_distributed, make_backend, shard_frozen_layers
from headstart.trainer.feature_store import FeatureStore, target_identity
from headstart.trainer.features import OnlineFeatures
from headstart.trainer.offline_features import OfflineFeatures
from headstart.trainer.loop import Trainer
from headstart.trainer.metrics import MetricsLogger


def token_counts(dataset: datasets.Dataset, vocab_size: int, cache_dir: str | None) -> torch.Tensor:
    """Loss-masked token counts of ``dataset``, cached beside the tokenized data."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    path = root / "token_counts" / f"{dataset._fingerprint}-{vocab_size}.safetensors"
    if path.is_file():
        return load_file(str(path))["counts"]
    counts = count_tokens(zip(dataset["input_ids"], dataset["loss_mask"]), vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{socket.gethostname()}-{os.getpid()}")  # unique on a cache several nodes share
    save_file({"counts": counts}, str(tmp))
    share_like_umask(tmp)
    os.replace(tmp, path)
    return counts


def tokenized_data(config: RunConfig, info: DistInfo):
    tokenizer = load_tokenizer(config.target.path, config.target.trust_remote_code)
    # Rank 0 tokenizes and fills the cache; then the first rank of every other node reads it (or, where the cache is
    # node-local, tokenizes once for its node); then every other rank reads its node's cache. Three barriers on
    # every rank, whichever turn is its own.
    turn = 0 if info.is_main else 1 if info.local_rank == 0 else 2
    for phase in range(3):
        if phase == turn:
            dataset, summary = build_dataset(config.data, tokenizer)
            if info.is_main:
                print(summary.format())
        barrier()
    return dataset


def build_trainer(config: RunConfig, info: DistInfo | None = None) -> Trainer:
    info = info or init_distributed()
    torch.manual_seed(config.train.seed)
    if config.draft.init_from is not None:  # before anything loads; train has no --allow-other-target
        check_readable(config.draft.init_from, "draft.init_from")
        check_target(config.draft.init_from, config.target.path,
                     remedy="set draft.init_from to a head trained for this target, or leave it unset to train from scratch")
    dataset = tokenized_data(config, info)
    data_fingerprint = dataset._fingerprint
    dataset = dataset.add_column("row", list(range(len(dataset))))  # the key of stored features
    train_data, eval_data = split_eval(dataset, config.train.eval_fraction, config.train.seed)

    offline = config.features.path is not None
    if offline:  # the target is never run: only its embeddings (and lm_head) are read
        if config.train.decode_eval_prompts > 0:
            raise ValueError("train.decode_eval_prompts runs the target; it is not available when training from "
                             "stored features (features.path)")
        target = TargetMatrices(config.target, device=info.device)
        store = FeatureStore(config.features.path)
        store.check_identity(target_identity(config.target.path, target.aux_layer_ids, config.target.dtype), data_fingerprint)
    else:
        target = Target.from_pretrained(replace(config.target, device=str(info.device)))
    counts = token_counts(train_data, target.vocab_size, config.data.cache_dir)
    head = build_head(config.draft, target, counts)  # checks the draft config against the target
    if config.parallel.shard_target and info.world_size > 1 and not offline:
        if config.parallel.backend != "fsdp":
            raise ValueError("parallel.shard_target is only supported with parallel.backend=fsdp")
        shard_frozen_layers(list(target.layers))
    decode_eval = None
    if config.train.decode_eval_prompts > 0:
        if eval_data is None:
            raise ValueError("train.decode_eval_prompts needs held-out rows: set train.eval_fraction > 0")
        tokenizer = load_tokenizer(config.target.path, config.target.trust_remote_code)
        eos = {t for t in (tokenizer.eos_token_id, target.model.generation_config.eos_token_id) if isinstance(t, int)}
        t = config.train
        decode_eval = DecodeEval(target, head, eval_data, t.decode_eval_prompts, t.decode_eval_max_new_tokens,
                                 t.decode_eval_k, eos, info, collective=config.parallel.shard_target and info.world_size > 1)
    if config.train.compile:  # after DecodeEval took its copy: evaluation decodes with the eager head
        if config.parallel.backend != "fsdp":
            raise ValueError("train.compile runs with parallel.backend=fsdp; DeepSpeed wraps the head's parameters in "
                             "its own way and has not been run with compiled parts")
        compiled = compile_parts(head, type(head).compiled)
        if info.is_main:
            print(f"train.compile: {', '.join(compiled)} through torch.compile", flush=True)
    backend = make_backend(head, config.train, config.parallel, info)
    module = backend.module
    if offline:
        features = OfflineFeatures(store, target, module.needs, module.target_vocab_ids().to(info.device),
                                   dtype_of(config.target.dtype))
    else:
        features = OnlineFeatures(target, module.needs, module.target_vocab_ids().to(info.device))

    layouts_for(module, config.export.format)  # refuse a layout the head has no writer for before training
    trained_for = fingerprint(config.target.path)

    def export_draft(state: dict[str, torch.Tensor], directory: Path) -> None:
        export_head(module, directory, config.draft.head, trained_for, config.export.format, state)

    if head.needs.aux_hidden_states:
        # Record what the head really reads: a recipe that leaves aux_layer_ids to the default says null,
        # and a reader of run_config.json should not have to know the default's formula.
        config = replace(config, target=replace(config.target, aux_layer_ids=tuple(target.aux_layer_ids)))
        if info.is_main:
            print(f"the head reads the target's hidden states {list(target.aux_layer_ids)} (HF hidden_states ids, "
                  f"of {target.num_layers} layers)", flush=True)
    out = Path(config.output_dir)
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "run_config.json").write_text(json.dumps(to_dict(config), indent=2))
    logger = MetricsLogger(out, config.logging, to_dict(config), info.is_main)
    trainer = Trainer(config, info, backend, features, train_data, eval_data, export_draft, logger, decode_eval)
    trainer.target_fingerprint = trained_for
    return trainer
