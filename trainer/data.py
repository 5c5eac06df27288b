"""Conversation files -> a tokenized ``datasets.Dataset`` of ``input_ids`` and ``loss_mask``.

Reads local JSON / JSONL / parquet through ``datasets``, normalises each row (``conversations``),
renders it with the tokenizer's chat template and masks everything but assistant turns (``chat``).
Tokenization runs in ``num_proc`` processes and the result is cached on disk under a key made of
the files' contents, the tokenizer and the options, so a second run starts in seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import datasets
from transformers import PreTrainedTokenizerBase

from headstart.trainer.chat import marker_spans, require_chat_template, tokenize_conversation, tokenize_text
from headstart.trainer.conversations import FORMATS, RowError, detect_format, to_messages

# Bump when the tokenization logic changes, so stale caches are not reused.
_CACHE_VERSION = 2  # 2: text rows get the tokenizer's leading special tokens (BOS)
_READERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


@dataclass(frozen=True)
class DataConfig:
    """How conversation files become training sequences."""

    files: tuple[str, ...] = ()
    """Local .json/.jsonl/.parquet files; ``path[a:b]`` reads only rows a..b-1 of one (a slice, as in Python and in
    ``datasets``' split syntax: ``data.jsonl[1000:]``), so held-out rows stay out without copying the file."""
    format: str | None = None
    """Row format for every file (sharegpt|messages|instruction|gsm8k|text); None detects it per file."""
    max_length: int = 2048
    """Sequences are truncated to this many tokens."""
    last_turn_only: bool = False
    """Train only on the last assistant turn of each conversation."""
    skip_bad_rows: bool = False
    """Skip (and count) malformed rows instead of stopping at the first one."""
    text_markers: tuple[str, str] | None = None
    """For 'text' rows: train only between these (start, end) markers; None trains on all tokens."""
    num_proc: int = 1
    """Processes used for tokenization."""
    cache_dir: str | None = None
    """Where tokenized datasets are cached; default $HEADSTART_CACHE or ~/.cache/headstart."""
    packing: bool = True
    """Pack each micro-batch's sequences into rows of at most ``tokens_per_batch`` tokens (first-fit decreasing)
    instead of padding every sequence to the longest; attention stays within each sequence, and every head's loss
    and gradients are the padded batch's (trainer/batches.py, tests/test_packing.py). false: pad."""
    tokens_per_batch: int | None = None
    """Token budget of one packed row; None: ``train.batch_size`` x ``max_length``, so a micro-batch is one row with
    no padding at all. A smaller budget splits it into several rows (bounding the attention's cross-sequence work).
    A step still trains the same sequences (``train.batch_size`` per rank and micro-batch on average, dealt by their
    work), so resume, resharding and the loss's denominator are unchanged."""

    def pack_tokens(self, batch_size: int) -> int | None:
        """What ``collate`` packs a micro-batch of ``batch_size`` sequences to: None when not packing."""
        return (self.tokens_per_batch or batch_size * self.max_length) if self.packing else None


@dataclass
class DataSummary:
    rows_read: int = 0
    rows_kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    truncated: int = 0
    tokens: int = 0
    trainable_tokens: int = 0

    def format(self) -> str:
        lines = [
            f"rows read        {self.rows_read:>12,}",
            f"rows kept        {self.rows_kept:>12,}",
            f"rows skipped     {sum(self.skipped.values()):>12,}",
        ]
        lines += [f"  {count:>8,} x {reason}" for reason, count in sorted(self.skipped.items(), key=lambda kv: -kv[1])]
        lines += [
            f"rows truncated   {self.truncated:>12,}",
            f"tokens           {self.tokens:>12,}",
            f"trainable tokens {self.trainable_tokens:>12,}"
            + (f"  ({self.trainable_tokens / self.tokens:.1%})" if self.tokens else ""),
        ]
        return "\n".join(lines)


_ROW_SLICE = re.compile(r"^(?P<file>.+)\[(?P<start>\d*):(?P<stop>\d*)\]$")


def split_rows(path: str) -> tuple[str, int, int | None]:
    """``"data.jsonl[250:500]"`` -> ``("data.jsonl", 250, 500)``; a plain path (or one that exists as written,
    brackets and all) -> ``(path, 0, None)``."""
    m = _ROW_SLICE.match(path)
    if m is None or Path(path).is_file():
        return path, 0, None
    start, stop = int(m["start"] or 0), int(m["stop"]) if m["stop"] else None
    if stop is not None and stop <= start:
        raise ValueError(f"{path}: empty row range {start}:{stop}")
    return m["file"], start, stop


def require_file(file: str) -> None:
    """Refuse a data file that is missing, or is a directory, by name."""
    p = Path(file)
    if p.is_dir():
        raise ValueError(f"data file {file} is a directory; give the .jsonl, .json or .parquet files in it "
                         f"(e.g. {file}/*.jsonl)")
    if not p.is_file():
        raise FileNotFoundError(f"data file not found: {file}")


def check_json_text(p: Path) -> None:
    """A JSON data file, refused by line where it is not UTF-8 or not JSON, or when it is empty: the reader's own
    errors name no line (and it reads some bad bytes as other characters)."""
    with p.open("rb") as f:  # stops at the first block that holds anything
        empty = not any(block.strip() for block in iter(lambda: f.read(1 << 20), b""))
    if empty:
        raise ValueError(f"{p}: the file is empty; expected conversation rows (one JSON object a line for .jsonl)")
    with p.open("rb") as f:
        document = f.read(64).lstrip().startswith(b"[")  # one JSON list of rows, not a row a line
    with p.open("rb") as f:
        for number, line in enumerate(f, 1):
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{p} line {number}: not UTF-8 text (byte 0x{line[err.start]:02x} at column "
                                 f"{err.start + 1}); save the file as UTF-8") from None
            if not document and text.strip():
                try:
                    json.loads(text)
                except ValueError as err:
                    raise ValueError(f"{p} line {number}: not valid JSON ({err.msg} at column {err.colno}); "
                                     "expected one JSON object a line") from None
    if document:
        try:
            json.loads(p.read_text(encoding="utf-8"))
        except ValueError as err:
            raise ValueError(f"{p} line {err.lineno}: not valid JSON ({err.msg} at column {err.colno})") from None


def read_rows(path: str) -> datasets.Dataset:
    """Load one local file (or its ``[a:b]`` rows) as a Dataset, with a clear error for a missing, empty or unreadable
    file (by line where it is not JSON or not UTF-8) or a range past its end."""
    file, start, stop = split_rows(path)
    p = Path(file)
    require_file(file)
    reader = _READERS.get(p.suffix.lower())
    if reader is None:
        raise ValueError(f"{file}: unsupported file type {p.suffix!r}; use .json, .jsonl or .parquet")
    if reader == "json":
        check_json_text(p)
    elif p.stat().st_size == 0:
        raise ValueError(f"{file}: the file is empty; expected conversation rows")
    try:
        rows = datasets.load_dataset(reader, data_files=str(p), split="train")
    except Exception as err:
        reason = str(err).strip() or type(err).__name__
        raise ValueError(f"{file}: could not be read as {reader} rows: {reason}") from err
    if (start, stop) == (0, None):
        return rows
    if start >= len(rows):
        raise ValueError(f"{path}: the file has {len(rows)} rows, none from row {start}")
    return rows.select(range(start, min(stop or len(rows), len(rows))))


def _row_to_tokens(row: dict[str, Any], *, fmt: str, tokenizer, config: DataConfig) -> dict[str, Any]:
    try:
        if fmt == "text":
            text = row.get("text")
            if not isinstance(text, str):
                raise RowError(f"'text' must be a string, got {type(text).__name__}")
            spans = marker_spans(text, *config.text_markers) if config.text_markers else None
            tok = tokenize_text(tokenizer, text, spans)
        else:
            tok = tokenize_conversation(tokenizer, to_messages(row, fmt), None, config.last_turn_only)
    except RowError as err:
        return {"input_ids": [], "loss_mask": [], "error": str(err), "truncated": False}
    truncated = len(tok.input_ids) > config.max_length
    ids, mask = tok.input_ids[: config.max_length], tok.loss_mask[: config.max_length]
    error = "" if any(mask) else "no trainable tokens" + (" after truncation" if truncated else "")
    return {"input_ids": ids, "loss_mask": mask, "error": error, "truncated": truncated}


def _tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    payload = (backend.to_str() if backend is not None else repr(tokenizer.get_vocab())) + str(tokenizer.chat_template)
    return hashlib.sha256(payload.encode()).hexdigest()


def _file_sha256(path: str) -> str:
    file, start, stop = split_rows(path)
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest() + ("" if (start, stop) == (0, None) else f"[{start}:{stop}]")


def cache_key(config: DataConfig, tokenizer: PreTrainedTokenizerBase) -> str:
    # How batches are laid out is no tokenization option: packing reads the same cached rows.
    options = {k: v for k, v in asdict(config).items()
               if k not in ("files", "num_proc", "cache_dir", "packing", "tokens_per_batch")}
    payload = json.dumps(
        {
            "version": _CACHE_VERSION,
            "files": [_file_sha256(f) for f in config.files],
            "tokenizer": _tokenizer_fingerprint(tokenizer),
            "options": options,
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def _reason_kind(reason: str) -> str:
    # "turn 3 has unknown role 'bot'" and "turn 5 ..." count as one reason in the summary.
    return re.sub(r"\bturn \d+", "turn N", reason)


def _tokenize_file(path: str, config: DataConfig, tokenizer, summary: DataSummary) -> datasets.Dataset:
    rows = read_rows(path)
    summary.rows_read += len(rows)
    if len(rows) == 0:
        return rows
    fmt = config.format
    if fmt is None:
        try:
            fmt = detect_format(rows[0])
        except RowError as err:
            raise ValueError(f"{path}: {err}") from err
    elif fmt not in FORMATS:
        raise ValueError(f"unknown row format {fmt!r}; choose one of {FORMATS}")
    if fmt != "text":
        require_chat_template(tokenizer)
    out = rows.map(
        _row_to_tokens,
        fn_kwargs={"fmt": fmt, "tokenizer": tokenizer, "config": config},
        remove_columns=rows.column_names,
        num_proc=config.num_proc if config.num_proc > 1 and len(rows) >= 2 * config.num_proc else None,
        load_from_cache_file=False,  # our own cache (keyed on contents) sits above this
        desc=f"tokenizing {Path(path).name}",
    )
    errors = out["error"]
    bad = [(i, e) for i, e in enumerate(errors) if e and not e.startswith("no trainable tokens")]
    if bad and not config.skip_bad_rows:
        file, first, _ = split_rows(path)  # rows are numbered in the file, not in its slice
        shown = "\n".join(f"  {file} row {first + i}: {e}" for i, e in bad[:5])
        more = f"\n  ... and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise ValueError(
            f"{len(bad)} bad row(s) in {path} (rows counted from 0):\n{shown}{more}\n"
            "Fix them, or pass skip_bad_rows (--skip-bad-rows) to skip and count them."
        )
    for reason, count in Counter(_reason_kind(e) for e in errors if e).items():
        summary.skipped[reason] = summary.skipped.get(reason, 0) + count
    summary.truncated += sum(out["truncated"])
    keep = [i for i, e in enumerate(errors) if not e]
    return out.select(keep).remove_columns(["error", "truncated"])


def default_cache_dir() -> Path:
    return Path(os.environ.get("HEADSTART_CACHE", Path.home() / ".cache" / "headstart"))


def build_dataset(config: DataConfig, tokenizer: PreTrainedTokenizerBase) -> tuple[datasets.Dataset, DataSummary]:
    """Tokenize ``config.files`` (or load them from the cache) and return the dataset and its summary."""
    if not config.files:
        raise ValueError("no data files given")
    for file in (split_rows(f)[0] for f in config.files):
        require_file(file)
    cache = Path(config.cache_dir) if config.cache_dir else default_cache_dir() / "tokenized"
    entry = cache / cache_key(config, tokenizer)
    if (entry / "summary.json").is_file():
        return datasets.load_from_disk(str(entry / "dataset")), DataSummary(**json.loads((entry / "summary.json").read_text()))

    summary = DataSummary()
    parts = [_tokenize_file(f, config, tokenizer, summary) for f in config.files]
    parts = [p for p in parts if len(p)]
    if not parts:
        raise ValueError("no usable rows in " + ", ".join(config.files))
    dataset = datasets.concatenate_datasets(parts)
    summary.rows_kept = len(dataset)
    lengths = [len(x) for x in dataset["input_ids"]]
    summary.tokens = sum(lengths)
    summary.trainable_tokens = sum(sum(m) for m in dataset["loss_mask"])
    # Written to a temp dir and renamed, so an interrupted run never leaves a half cache entry.
    tmp = entry.with_name(entry.name + f".tmp-{socket.gethostname()}-{os.getpid()}")  # unique across nodes too
    dataset.save_to_disk(str(tmp / "dataset"))
    (tmp / "summary.json").write_text(json.dumps(asdict(summary)))
    entry.parent.mkdir(parents=True, exist_ok=True)
    if entry.exists():  # another process finished first; theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(entry)
    return datasets.load_from_disk(str(entry / "dataset")), summary
