"""Run the frozen target once over the tokenized training data and store what training needs.

    torchrun --nproc_per_node 2 scripts/generate_features.py --config configs/demo/eagle3.yaml \
        --features.path=runs/demo-features
    torchrun --nproc_per_node 2 scripts/train_eagle3.py --config configs/demo/eagle3.yaml \
        --features.path=runs/demo-features                     # trains without running the target

The recipe is the training one: target (path, dtype, aux layer ids), data, the head (``draft.head``:
only the tensors it reads are stored) and the ``features`` section (storage: ``aux`` fp8|bf16,
``hidden`` bf16|fp8, ``target_dist`` topk|hidden, ``topk``); ``parallel.shard_target: true`` shards the target's
layers over the ranks (a target larger than one GPU). Rank r takes rows r, r+N, ...; each rank writes its shards
atomically, a job restarted with --resume skips finished shards (and rebuilds any that were altered), and rank 0
writes manifest.json last. See trainer/feature_store.py for the format.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from headstart.trainer.progress import progress_bar

from headstart.heads.registry import head_spec
from headstart.models.target import Target
from headstart.trainer.batches import collate
from headstart.trainer.config import load_config
from headstart.trainer.errors import report_error
from headstart.trainer.output_dir import JOB_PLAN, claim_output_dir
from headstart.trainer.distributed import DistInfo, barrier, init_distributed, shard_frozen_layers
from headstart.trainer.feature_store import (
    Storage,
    encode_sample,
    finished_shard,
    shard_name,
    target_identity,
    write_manifest,
    write_shard,
)
from headstart.trainer.run import tokenized_data
from headstart.scripts.command import entry_point, refusals


def check_plan(out: Path, plan: dict, is_main: bool) -> None:
    """A restart must split rows the same way, or finished shards would hold other rows."""
    path = out / "plan.json"
    if path.is_file():
        old = json.loads(path.read_text())
        if old != plan:
            raise ValueError(f"{out} was started with {old}; resume it with the same settings (now {plan}) "
                             "or write to a new features.path")
    elif is_main:
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(plan))
    barrier()


def most_forwards(forwards: int, info: DistInfo) -> int:
    """The most forwards any rank runs (collective: called before any forward, so that it pairs with no gather)."""
    most = torch.tensor(forwards, device=info.device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most)


def lockstep(target: Target, owed: int, info: DistInfo) -> None:
    """With a sharded target: the forwards this rank owes the others (its rows ran out first, or its shards were done
    before a --resume). Each one gathers the layers as a real forward does; a one-token input is enough."""
    one = torch.zeros(1, 1, dtype=torch.long, device=info.device)
    with torch.no_grad():
        for _ in range(owed):
            target(one, attention_mask=torch.ones_like(one), with_aux=False)


def generate(config, resume: bool = False, overwrite: bool = False) -> dict | None:
    info = init_distributed()
    fc = config.features
    if not fc.path:
        raise ValueError("set features.path: the directory the features are written to")
    claim_output_dir(fc.path, JOB_PLAN, "feature job", resume, overwrite, info)
    storage = Storage.for_head(head_spec(config.draft.head).cls.needs, fc.aux, fc.target_dist, fc.topk, fc.hidden)
    out = Path(fc.path)
    dataset = tokenized_data(config, info)
    target = Target.from_pretrained(replace(config.target, device=str(info.device)))
    # A target too large for one GPU (70B-class) is sharded over the ranks as training shards it: every forward then
    # gathers each layer from all ranks, so all ranks run the same number of forwards (see ``lockstep``).
    sharded = config.parallel.shard_target and info.world_size > 1
    if sharded:
        shard_frozen_layers(list(target.layers))
    identity = target_identity(config.target.path, target.aux_layer_ids, config.target.dtype)
    plan = {"world_size": info.world_size, "samples_per_shard": fc.samples_per_shard, "num_rows": len(dataset),
            "data_fingerprint": dataset._fingerprint, "target": identity,
            "storage": storage.to_dict()}
    check_plan(out, plan, info.is_main)

    rows = list(range(info.rank, len(dataset), info.world_size))
    shards = [rows[i : i + fc.samples_per_shard] for i in range(0, len(rows), fc.samples_per_shard)]
    lengths = dataset.select(rows)["input_ids"] if rows else []
    bar = progress_bar(total=sum(len(x) for x in lengths), unit="tok", unit_scale=True, desc=f"features rank {info.rank}",
               disable=not info.is_main, dynamic_ncols=True)
    n_aux, full_vocab = len(target.aux_layer_ids), target.vocab_head()
    skipped, rebuilt, todo = 0, [], []
    for index, shard_rows in enumerate(shards):
        name = shard_name(info.rank, index)
        done = finished_shard(out, name, shard_rows, verify=True)  # a resumed job rebuilds what training refused
        if done is not None:
            skipped += 1
            bar.update(done["offsets"][-1])
            continue
        if (out / f"{name}.json").is_file():
            rebuilt.append(name)
        todo.append((name, shard_rows))
    forwards = sum(-(-len(shard_rows) // fc.batch_size) for _, shard_rows in todo)
    owed = most_forwards(forwards, info) - forwards if sharded else 0
    for name, shard_rows in todo:
        samples = []
        for start in range(0, len(shard_rows), fc.batch_size):
            batch_rows = shard_rows[start : start + fc.batch_size]
            batch = collate(dataset, batch_rows)
            ids, mask = batch["input_ids"].to(info.device), batch["attention_mask"].to(info.device)
            with torch.no_grad():
                result = target(ids, attention_mask=mask, with_aux=storage.aux is not None)
            for b in range(len(batch_rows)):
                n = int(mask[b].sum())
                aux = None if result.aux_hidden_states is None else result.aux_hidden_states[b, :n]
                samples.append(encode_sample(ids[b, :n], batch["loss_mask"][b, :n], aux, result.last_hidden_state[b, :n],
                                             full_vocab, storage, n_aux))
                bar.update(n)
        write_shard(out, name, shard_rows, samples)
    lockstep(target, owed, info)
    bar.close()
    if skipped and info.is_main:
        print(f"resumed: skipped {skipped} finished shard(s) of rank 0")
    for name in rebuilt:
        print(f"[rank {info.rank}] rebuilt {name}, which was missing, truncated or altered")
    barrier()
    if not info.is_main:
        return None
    infos = []
    for rank in range(info.world_size):
        mine = list(range(rank, len(dataset), info.world_size))
        for index in range(0, -(-len(mine) // fc.samples_per_shard)):
            shard_rows = mine[index * fc.samples_per_shard : (index + 1) * fc.samples_per_shard]
            done = finished_shard(out, shard_name(rank, index), shard_rows)
            if done is None:
                raise RuntimeError(f"rank {rank} shard {index} is missing or incomplete in {out}")
            infos.append(done)
    manifest = write_manifest(out, identity, storage, target.hidden_size, n_aux, dataset._fingerprint, infos)
    per_token = manifest["bytes"] / max(1, manifest["num_tokens"])
    reference = 8 * target.hidden_size + 16  # SpecForge: 3 aux + last hidden in bf16, ids and mask
    print(f"{manifest['num_samples']:,} samples, {manifest['num_tokens']:,} tokens, {manifest['bytes'] / 2**20:,.1f} MiB: "
          f"{per_token:,.1f} bytes/token ({per_token / reference:.2f} of SpecForge's 8H+16 = {reference})")
    return manifest


@refusals
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="recipe YAML (the training recipe)")
    p.add_argument("--resume", action="store_true", help="continue the job in features.path (skips its finished shards)")
    p.add_argument("--overwrite", action="store_true",
                   help="move the features in features.path aside (to <path>.old-<time>) and start again")
    args, overrides = p.parse_known_args(argv)
    try:
        generate(load_config(args.config, overrides), args.resume, args.overwrite)
        barrier()  # leave together: rank 0 writes the manifest while the others would already tear down gloo
    except (ValueError, OSError) as err:  # OSError: a full disk, an unwritable features.path
        return report_error(err)
    finally:
        gc.collect()  # drop finished collective work while the interpreter is fully alive
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(entry_point(main))
