"""The offline feature store: what the frozen target computed for every training row, on disk.

Layout of a store directory::

    plan.json                         world size and shard size of the job (a restart must match)
    shard-r000-00000.safetensors      the rows of one rank's shard, tokens concatenated
    shard-r000-00000.json             its sidecar: rows, offsets, byte size, crc32 (written after the shard)
    manifest.json                     written last: the target's identity, storage, every shard

A shard holds, per token, ``input_ids`` int32 and ``loss_mask`` uint8, and of the target's tensors
only what the head reads (``Storage.for_head``): the aux hidden states (``aux`` [N, n, H] bf16, or
fp8 e4m3 with a bf16 scale per token and layer in ``aux_scale``) for EAGLE-3; the final hidden state
(``hidden`` [N, H] bf16 -- exact, the lm_head is applied at training time -- or fp8 with a bf16
scale per token in ``hidden_scale``) for heads that read it (Medusa, MTP) or as EAGLE-3's source of
the target distribution; or, for EAGLE-3, the target's top-k probabilities over the full vocab
(``topk_ids`` int32, ``topk_probs`` fp16), which serve any draft vocab.

Shards appear atomically (temp file + rename, sidecar after the shard, manifest last), so a killed
job restarts by skipping finished shards. A reader checks each shard's size and crc32 on first use
and names the shard it refuses; it opens shards lazily, memory-mapped.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from headstart.models.files import share_like_umask
from headstart.models.head import FeatureNeeds

FORMAT_VERSION = 2  # 2: aux / hidden / top-k each optional, chosen by what the head reads
FP8_MAX = 448.0  # largest finite float8_e4m3fn


REBUILD = ("Rebuild the refused shards: run scripts/generate_features.py again with the same recipe, the same number of "
           "ranks and --resume; it checks every shard and rewrites exactly the missing or altered ones. Training "
           "stopped before the optimizer step that would have read it; its last checkpoint resumes with --resume")


class CorruptShardError(ValueError):
    pass


def file_crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def sha256_files(*paths: Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        if p.is_file():
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def target_identity(target_path: str, aux_layer_ids: tuple[int, ...], dtype: str) -> dict:
    """What must match between the features and the training run: the target's config, its layer
    ids and dtype, and its tokenizer."""
    root = Path(target_path)
    config = json.loads((root / "config.json").read_text())
    config.pop("_name_or_path", None)
    config.pop("transformers_version", None)
    tokenizer_files = [root / n for n in ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "tokenizer_config.json")]
    return {
        "config_sha256": hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16],
        "aux_layer_ids": list(aux_layer_ids),
        "dtype": dtype,
        "tokenizer_sha256": sha256_files(*tokenizer_files),
    }


@dataclass(frozen=True)
class Storage:
    """What a store keeps per token besides ids and mask; None = not stored."""

    aux: str | None = "fp8"  # fp8 | bf16 | None: the aux hidden states
    hidden: str | None = None  # bf16 | fp8 | None: the final hidden state
    topk: int | None = 32  # k of the stored top-k probabilities, or None

    def __post_init__(self) -> None:
        if self.aux not in ("fp8", "bf16", None) or self.hidden not in ("fp8", "bf16", None) or (
                self.topk is not None and self.topk < 1):
            raise ValueError(f"feature storage: aux and hidden must be fp8|bf16, topk >= 1; got {self}")

    @classmethod
    def for_head(cls, needs: FeatureNeeds, aux: str = "fp8", target_dist: str = "topk", topk: int = 32,
                 hidden: str = "bf16") -> "Storage":
        """Exactly what a head with ``needs`` reads. Its draft-vocab distribution comes from stored top-k
        probabilities (``target_dist=topk``) or from the final hidden state (``hidden``)."""
        if target_dist not in ("topk", "hidden"):
            raise ValueError(f"features.target_dist must be topk or hidden, got {target_dist!r}")
        dist_from_hidden = needs.draft_vocab_logits and target_dist == "hidden"
        return cls(aux=aux if needs.aux_hidden_states else None,
                   hidden=hidden if needs.last_hidden_state or dist_from_hidden else None,
                   topk=topk if needs.draft_vocab_logits and not dist_from_hidden else None)

    def to_dict(self) -> dict:
        return {"aux": self.aux, "hidden": self.hidden, "topk": self.topk}

    def bytes_per_token(self, hidden_size: int, n_aux: int) -> int:
        """What a stored token takes on disk (``encode_sample``): int32 id, uint8 mask, the aux states (fp8 with a
        bf16 scale per layer, or bf16), the final hidden state, and the top-k ids (int32) and probabilities (fp16)."""
        size = 4 + 1
        size += {"fp8": n_aux * (hidden_size + 2), "bf16": 2 * n_aux * hidden_size, None: 0}[self.aux]
        size += {"fp8": hidden_size + 2, "bf16": 2 * hidden_size, None: 0}[self.hidden]
        return size + (self.topk or 0) * (4 + 2)

    def check_serves(self, needs: FeatureNeeds, where: Path) -> None:
        """Refuse, by name, a store that lacks a tensor the head reads."""
        missing = [what for what, needed, have in (
            ("aux hidden states", needs.aux_hidden_states, self.aux is not None),
            ("final hidden states", needs.last_hidden_state, self.hidden is not None),
            ("the target distribution (top-k or final hidden states)", needs.draft_vocab_logits,
             self.hidden is not None or self.topk is not None)) if needed and not have]
        if missing:
            raise ValueError(f"features in {where} hold no {' and no '.join(missing)}, which this head reads; they "
                             "were generated for another head: run scripts/generate_features.py with this run's draft.head")


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] -> (fp8 e4m3 [..., H], bf16 scale [...]) with one absmax scale per row."""
    scale = (x.float().abs().amax(-1) / FP8_MAX).clamp(min=1e-12).to(torch.bfloat16)
    return (x.float() / scale.float().unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def encode_sample(input_ids: torch.Tensor, loss_mask: torch.Tensor, aux: torch.Tensor | None, last_hidden: torch.Tensor,
                  target_logits_fn, storage: Storage, n_aux: int) -> dict[str, torch.Tensor]:
    """One sample's tensors ([T] ids/mask, aux [T, n*H] or None, last hidden [T, H]) in storage form."""
    T = input_ids.numel()
    out = {"input_ids": input_ids.to(torch.int32), "loss_mask": loss_mask.to(torch.uint8)}
    if storage.aux == "fp8":
        out["aux"], out["aux_scale"] = quantize_fp8(aux.reshape(T, n_aux, -1))
    elif storage.aux == "bf16":
        out["aux"] = aux.reshape(T, n_aux, -1).to(torch.bfloat16)
    if storage.hidden == "fp8":
        out["hidden"], out["hidden_scale"] = quantize_fp8(last_hidden)
    elif storage.hidden == "bf16":
        out["hidden"] = last_hidden.to(torch.bfloat16)
    if storage.topk is not None:
        ids, probs = [], []
        for chunk in last_hidden.split(1024):  # [1024, V] float32 at a time, not [T, V]
            top = torch.softmax(target_logits_fn(chunk).float(), dim=-1).topk(storage.topk, dim=-1)
            ids.append(top.indices.to(torch.int32))
            probs.append(top.values.to(torch.float16))
        out["topk_ids"], out["topk_probs"] = torch.cat(ids), torch.cat(probs)
    return {k: v.detach().cpu().contiguous() for k, v in out.items()}


def shard_name(rank: int, index: int) -> str:
    return f"shard-r{rank:03d}-{index:05d}"


def write_shard(directory: Path, name: str, rows: list[int], samples: list[dict[str, torch.Tensor]]) -> dict:
    """Concatenate the samples, write the shard then its sidecar, each atomically."""
    lengths = [s["input_ids"].numel() for s in samples]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    tensors = {k: torch.cat([s[k] for s in samples]) for k in samples[0]}
    path, tmp = directory / f"{name}.safetensors", directory / f".{name}.safetensors.tmp"
    save_file(tensors, str(tmp))
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    info = {"file": path.name, "rows": rows, "offsets": offsets, "size": tmp.stat().st_size, "crc32": file_crc32(tmp)}
    share_like_umask(tmp)  # safetensors writes 0600: a training job running as another user reads these shards
    os.replace(tmp, path)
    side_tmp = directory / f".{name}.json.tmp"
    side_tmp.write_text(json.dumps(info))
    os.replace(side_tmp, directory / f"{name}.json")
    return info


def finished_shard(directory: Path, name: str, rows: list[int], verify: bool = False) -> dict | None:
    """The sidecar of a shard a previous run completed for exactly these rows, else None.
    ``verify``: also read it whole and compare its crc32 (a resumed job rebuilds an altered shard)."""
    side, path = directory / f"{name}.json", directory / f"{name}.safetensors"
    if not side.is_file() or not path.is_file():
        return None
    info = json.loads(side.read_text())
    if info["rows"] != rows or path.stat().st_size != info["size"]:
        return None
    if verify and file_crc32(path) != info["crc32"]:
        return None
    return info


def write_manifest(directory: Path, identity: dict, storage: Storage, hidden_size: int, n_aux: int,
                   data_fingerprint: str, shards: list[dict]) -> dict:
    num_tokens = sum(s["offsets"][-1] for s in shards)
    manifest = {
        "format_version": FORMAT_VERSION,
        "target": identity,
        "storage": storage.to_dict(),
        "hidden_size": hidden_size,
        "num_aux_layers": n_aux,
        "data_fingerprint": data_fingerprint,
        "num_samples": sum(len(s["rows"]) for s in shards),
        "num_tokens": num_tokens,
        "bytes": sum(s["size"] for s in shards),
        "shards": sorted(shards, key=lambda s: s["file"]),
    }
    tmp = directory / ".manifest.json.tmp"
    tmp.write_text(json.dumps(manifest))
    os.replace(tmp, directory / "manifest.json")
    return manifest


class FeatureStore:
    """Read side: row -> stored tensors, shards opened lazily and checked on first use."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        path = self.directory / "manifest.json"
        if not path.is_file():
            raise FileNotFoundError(f"{self.directory}: no manifest.json; the feature job did not finish "
                                    "(run scripts/generate_features.py again with --resume: it skips the finished shards)")
        self.manifest = json.loads(path.read_text())
        if self.manifest.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path}: feature format {self.manifest.get('format_version')} (this headstart reads {FORMAT_VERSION})")
        try:
            self.storage = Storage(**self.manifest["storage"])
        except TypeError as err:
            raise ValueError(f"{path}: unreadable 'storage' entry {self.manifest['storage']!r} ({err})") from None
        self.index: dict[int, tuple[int, int, int]] = {}  # row -> (shard, start, end)
        for i, shard in enumerate(self.manifest["shards"]):
            offsets = shard["offsets"]
            for j, row in enumerate(shard["rows"]):
                self.index[row] = (i, offsets[j], offsets[j + 1])
        self._open: dict[int, object] = {}

    def check_identity(self, expected: dict, data_fingerprint: str | None = None) -> None:
        """Refuse features made by another target, other layer ids, dtype or tokenizer."""
        stored = self.manifest["target"]
        names = {"config_sha256": "target config", "aux_layer_ids": "aux layer ids", "dtype": "target dtype",
                 "tokenizer_sha256": "tokenizer"}
        for key, what in names.items():
            if stored.get(key) != expected.get(key):
                raise ValueError(f"features in {self.directory} were made with another {what} "
                                 f"({stored.get(key)} there, {expected.get(key)} in this run); regenerate them "
                                 "with scripts/generate_features.py for this target")
        if data_fingerprint is not None and self.manifest["data_fingerprint"] != data_fingerprint:
            raise ValueError(f"features in {self.directory} were made from other training data (or other data "
                             "options) than this run's; regenerate them for this data")

    def _shard(self, i: int):
        if i not in self._open:
            problem = self._check(i)
            if problem:
                raise CorruptShardError(f"{problem}. {REBUILD}")
        return self._open[i]

    def _check(self, i: int) -> str | None:
        """Open shard ``i`` after checking it against the manifest; what is wrong with it, if anything."""
        if i in self._open:
            return None
        info = self.manifest["shards"][i]
        path = self.directory / info["file"]
        if not path.is_file():
            return f"feature shard {path} is missing"
        size = path.stat().st_size
        if size != info["size"]:
            return f"feature shard {path} is truncated or altered: {size} bytes, manifest says {info['size']}"
        if file_crc32(path) != info["crc32"]:
            return f"feature shard {path} is corrupt: its crc32 does not match the manifest"
        try:
            self._open[i] = safe_open(str(path), framework="pt")
        except Exception as err:  # safetensors raises its own error type
            return f"feature shard {path} cannot be read: {err}"
        return None

    def problems(self, rows: list[int]) -> list[str]:
        """What is wrong with the shards holding ``rows`` (checked, and opened, on first use)."""
        shards = sorted({self.index[r][0] for r in rows if r in self.index})
        return [p for p in (self._check(i) for i in shards) if p]

    def __contains__(self, row: int) -> bool:
        return row in self.index

    def get(self, row: int) -> dict[str, torch.Tensor]:
        if row not in self.index:
            raise KeyError(f"row {row} has no stored features in {self.directory}")
        i, start, end = self.index[row]
        f = self._shard(i)
        return {k: f.get_slice(k)[start:end] for k in f.keys()}
