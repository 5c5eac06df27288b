"""Regenerate a dataset's assistant turns with the target (EAGLE-3 paper, SpecForge, speculators):
a draft head is used on the target's own outputs, so it should be trained on them.

Rows are read by the same readers as training data (``trainer.data`` / ``trainer.conversations``:
the same formats and bad-row errors). Each conversation is regenerated turn by turn: the reply to
user turn n sees the regenerated replies before it; user and system turns are kept. One output row
per input row, in OpenAI-messages JSONL that ``prepare_data.py`` and the recipes read unchanged:

    {"messages": [...], "source": {"file": ..., "row": 12}, "finish_reasons": ["stop", ...],
     "generated_tokens": 231, "sampling": {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 1024, "seed": 0}}

Layout of the output directory:

    plan.json                   the settings; a restart with other settings is refused
    shards/shard-00012.jsonl    global rows [12 S, 13 S), written atomically (temp file + rename)
    regenerated.jsonl           every shard in order, written last (atomically): what training reads

Shard k holds global rows [k S, (k+1) S) and goes to rank k mod world_size, so a killed job restarts
(on any number of ranks) by skipping the shards that exist. A row whose request keeps failing leaves
its shard unwritten and is reported by file and row; the next run retries it.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from headstart.trainer.conversations import RowError, detect_format, to_messages
from headstart.trainer.data import read_rows
from headstart.trainer.reply_backends import Message, Reply, RowFailed, SamplingSettings

PLAN_VERSION = 1


@dataclass(frozen=True)
class Source:
    file: str
    row: int
    messages: list[Message]


@dataclass
class Summary:
    rows: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    turns: int = 0
    tokens: int = 0
    finish_reasons: Counter = field(default_factory=Counter)
    rows_at_length_limit: int = 0
    failed: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, row: dict) -> None:
        self.rows += 1
        self.turns += len(row["finish_reasons"])
        self.tokens += row["generated_tokens"]
        self.finish_reasons.update(row["finish_reasons"])
        self.rows_at_length_limit += "length" in row["finish_reasons"]

    def format(self) -> str:
        rate = f"  ({self.rows / self.seconds:.2f} rows/s, {self.tokens / self.seconds:.1f} tokens/s)" if self.seconds else ""
        lines = [f"rows regenerated   {self.rows:>10,}{rate}", f"assistant turns    {self.turns:>10,}",
                 f"generated tokens   {self.tokens:>10,}",
                 "finish reasons     " + ", ".join(f"{k} {v:,}" for k, v in sorted(self.finish_reasons.items())),
                 f"rows that hit max_new_tokens {self.rows_at_length_limit:,}"]
        lines += [f"rows skipped       {n:>10,} x {reason}" for reason, n in self.skipped.items()]
        lines += [f"FAILED: {f}" for f in self.failed]
        return "\n".join(lines)


def read_sources(files: list[str], fmt: str | None = None, skip_bad_rows: bool = False,
                 skipped: dict[str, int] | None = None, rows_per_file: int | None = None) -> list[Source]:
    """Every conversation of ``files`` in order (the first ``rows_per_file`` of each, if given); a bad
    row stops with its file and row unless ``skip_bad_rows`` (then it is counted in ``skipped``)."""
    sources = []
    for path in files:
        rows = read_rows(path)
        if rows_per_file is not None:
            rows = rows.select(range(min(rows_per_file, len(rows))))
        row_fmt = fmt or (detect_format(rows[0]) if len(rows) else "messages")
        if row_fmt == "text":
            raise ValueError(f"{path}: 'text' rows have no turns to regenerate; give conversations")
        for i, row in enumerate(rows):
            try:
                sources.append(Source(path, i, to_messages(row, row_fmt)))
            except RowError as err:
                if not skip_bad_rows:
                    raise ValueError(f"{path} row {i}: {err} (or pass --skip-bad-rows)") from None
                if skipped is not None:
                    skipped[str(err)] = skipped.get(str(err), 0) + 1
    return sources


def regenerate_rows(sources: list[Source], generate: Callable[[list[list[Message]], int], list[Reply]], seed: int,
                    sampling: SamplingSettings) -> list[dict]:
    """Turn by turn across the batch: at step j every conversation with a j-th assistant turn gets the
    target's reply to its prefix (its own earlier turns already regenerated)."""
    convs = [[m for m in s.messages] for s in sources]
    out = [{"finish_reasons": [], "generated_tokens": 0} for _ in sources]
    positions = [[i for i, m in enumerate(c) if m["role"] == "assistant"] for c in convs]
    for j in range(max(len(p) for p in positions)):
        todo = [i for i, p in enumerate(positions) if j < len(p)]
        replies = generate([convs[i][: positions[i][j]] for i in todo], seed + 1000 * j)
        for i, reply in zip(todo, replies):
            convs[i][positions[i][j]] = {"role": "assistant", "content": reply.text}
            out[i]["finish_reasons"].append(reply.finish_reason)
            out[i]["generated_tokens"] += reply.tokens
    for i, (s, c) in enumerate(zip(sources, convs)):
        # a trailing user turn (no reply to regenerate) is dropped: training has nothing to learn from it
        last = max(k for k, m in enumerate(c) if m["role"] == "assistant")
        out[i] = {"messages": c[: last + 1], "source": {"file": s.file, "row": s.row}, **out[i],
                  "sampling": sampling.as_dict()}
    return out


def files_sha256(files: list[str]) -> str:
    h = hashlib.sha256()
    for path in files:
        h.update(Path(path).name.encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def check_plan(out: Path, plan: dict, is_main: bool) -> None:
    """Finished shards are only valid for the settings that wrote them: refuse others by name."""
    path = out / "plan.json"
    if path.is_file():
        old = json.loads(path.read_text())
        differs = sorted(k for k in set(old) | set(plan) if old.get(k) != plan.get(k))
        if differs:
            raise ValueError(f"{out} holds rows regenerated with other settings ("
                             + "; ".join(f"{k}: {old.get(k)!r} there, {plan.get(k)!r} now" for k in differs)
                             + "): resume with the same settings or choose another --output")
    elif is_main:
        (out / "shards").mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(plan, indent=2))
        os.replace(tmp, path)


def shard_path(out: Path, k: int) -> Path:
    return out / "shards" / f"shard-{k:05d}.jsonl"


def write_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def run_shards(out: Path, sources: list[Source], generate, sampling: SamplingSettings, rows_per_shard: int,
               rank: int = 0, world_size: int = 1, progress: bool = True) -> Summary:
    """Regenerate this rank's missing shards; returns what this rank did."""
    summary = Summary()
    n_shards = (len(sources) + rows_per_shard - 1) // rows_per_shard
    mine = [k for k in range(rank, n_shards, world_size) if not shard_path(out, k).is_file()]
    rows_todo = sum(len(sources[k * rows_per_shard:(k + 1) * rows_per_shard]) for k in mine)
    bar = tqdm(total=rows_todo, unit="row", disable=not progress or rank != 0, dynamic_ncols=True,
               desc=f"regenerating ({len(mine)} of {n_shards} shards left)")
    start = time.perf_counter()
    for k in mine:
        chunk = sources[k * rows_per_shard:(k + 1) * rows_per_shard]
        try:
            rows = regenerate_rows(chunk, generate, sampling.seed + k * rows_per_shard, sampling)
        except RowFailed as err:
            where = f"{chunk[0].file} row {chunk[0].row} .. {chunk[-1].file} row {chunk[-1].row}"
            summary.failed.append(f"shard {k} ({where}): {err}")
            bar.update(len(chunk))
            continue
        write_jsonl(shard_path(out, k), rows)
        for row in rows:
            summary.add(row)
        bar.update(len(chunk))
        summary.seconds = time.perf_counter() - start
        bar.set_postfix_str(f"{summary.tokens / max(summary.seconds, 1e-9):.0f} tok/s")
    bar.close()
    summary.seconds = time.perf_counter() - start
    return summary


def concatenate(out: Path, n_rows: int, rows_per_shard: int) -> Path | None:
    """Write regenerated.jsonl from every shard, in order; None while a shard is missing."""
    n_shards = (n_rows + rows_per_shard - 1) // rows_per_shard
    paths = [shard_path(out, k) for k in range(n_shards)]
    if not all(p.is_file() for p in paths):
        return None
    final = out / "regenerated.jsonl"
    tmp = final.with_name(f".{final.name}.tmp")
    with tmp.open("w") as f:
        for p in paths:
            f.write(p.read_text())
    os.replace(tmp, final)
    return final
