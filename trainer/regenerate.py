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
    shards/shard-00012.failed.jsonl  the rows of that shard that failed for good, with the reason
    regenerated.jsonl           every shard in order, written last (atomically): what training reads
    failed.jsonl                every row that failed for good

Shard k holds global rows [k S, (k+1) S). Every rank lists the missing shards and takes every
world_size-th, so a killed job restarts (on any number of ranks) by skipping the shards that exist. A
row whose request keeps failing (server down, overloaded) leaves its shard unwritten and is reported by
file and row; the next run retries it. A row that can never succeed (its prompt does not fit the
context, the server refuses it, the reply is empty) is reported the same way and listed in
failed.jsonl, so the rest of the data still completes.
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

from headstart.trainer.progress import progress_bar

from headstart.trainer.conversations import RowError, detect_format, to_messages
from headstart.trainer.data import read_rows, split_rows
from headstart.trainer.reply_backends import Failure, Message, Reply, SamplingSettings

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
        lines += [f"failed for good: {f}" for f in self.failed]
        return "\n".join(lines)


def read_sources(files: list[str], fmt: str | None = None, skip_bad_rows: bool = False,
                 skipped: dict[str, int] | None = None, rows_per_file: int | None = None) -> list[Source]:
    """Every conversation of ``files`` in order (the first ``rows_per_file`` of each, if given); a bad
    row stops with its file and row unless ``skip_bad_rows`` (then it is counted in ``skipped``)."""
    sources = []
    for path in files:
        rows = read_rows(path)
        file, first, _ = split_rows(path)  # a source is its row in the file, so a slice's seeds are the whole file's
        if rows_per_file is not None:
            rows = rows.select(range(min(rows_per_file, len(rows))))
        try:
            row_fmt = fmt or (detect_format(rows[0]) if len(rows) else "messages")
        except RowError as err:
            raise ValueError(f"{path}: {err}") from None
        if row_fmt == "text":
            raise ValueError(f"{path}: 'text' rows have no turns to regenerate; give conversations")
        for i, row in enumerate(rows):
            try:
                sources.append(Source(file, first + i, to_messages(row, row_fmt)))
            except RowError as err:
                if not skip_bad_rows:
                    raise ValueError(f"{file} row {first + i}: {err} (or pass --skip-bad-rows)") from None
                if skipped is not None:
                    skipped[str(err)] = skipped.get(str(err), 0) + 1
    return sources


def row_seed(seed: int, source: Source, turn: int) -> int:
    """The seed of one row's reply to one turn: independent of batching, shards and ranks."""
    key = f"{seed}:{Path(source.file).name}:{source.row}:{turn}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "little") & 0x7FFFFFFF


def regenerate_rows(sources: list[Source], generate: Callable[[list[list[Message]], list[int]], list[Reply | Failure]],
                    sampling: SamplingSettings) -> tuple[list[dict], list[tuple[Source, Failure]]]:
    """Turn by turn across the batch: at step j every conversation with a j-th assistant turn gets the
    target's reply to its prefix (its own earlier turns already regenerated). A conversation whose
    reply fails stops there and is returned with its failure, not written half-done."""
    convs = [[dict(m) for m in s.messages] for s in sources]
    done = [{"finish_reasons": [], "generated_tokens": 0} for _ in sources]
    positions = [[i for i, m in enumerate(c) if m["role"] == "assistant"] for c in convs]
    failed: dict[int, Failure] = {}
    for j in range(max(len(p) for p in positions)):
        todo = [i for i, p in enumerate(positions) if j < len(p) and i not in failed]
        if not todo:
            break
        replies = generate([convs[i][: positions[i][j]] for i in todo], [row_seed(sampling.seed, sources[i], j) for i in todo])
        for i, reply in zip(todo, replies):
            if isinstance(reply, Failure):
                failed[i] = Failure(f"turn {positions[i][j]}: {reply.reason}", reply.permanent)
                continue
            convs[i][positions[i][j]] = {"role": "assistant", "content": reply.text}
            done[i]["finish_reasons"].append(reply.finish_reason)
            done[i]["generated_tokens"] += reply.tokens
    rows = []
    for i, (s, c) in enumerate(zip(sources, convs)):
        if i in failed:
            continue
        # a trailing user turn (no reply to regenerate) is dropped: training has nothing to learn from it
        last = max(k for k, m in enumerate(c) if m["role"] == "assistant")
        rows.append({"messages": c[: last + 1], "source": {"file": s.file, "row": s.row}, **done[i],
                     "sampling": sampling.as_dict()})
    return rows, [(sources[i], f) for i, f in sorted(failed.items())]


def files_sha256(files: list[str]) -> str:
    """A short digest of the data files' contents and names, a ``[a:b]`` row slice included in its name."""
    h = hashlib.sha256()
    for path in files:
        h.update(Path(path).name.encode())
        with open(split_rows(path)[0], "rb") as f:
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
        out.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(plan, indent=2))
        os.replace(tmp, path)


def shard_path(out: Path, k: int, failed: bool = False) -> Path:
    return out / "shards" / f"shard-{k:05d}{'.failed' if failed else ''}.jsonl"


def missing_shards(out: Path, n_rows: int, rows_per_shard: int) -> list[int]:
    """Shards not written yet. Listed by every rank before any of them writes (then split rank::world),
    so a resumed job spreads what is left evenly, on any number of ranks."""
    n_shards = (n_rows + rows_per_shard - 1) // rows_per_shard
    return [k for k in range(n_shards) if not shard_path(out, k).is_file()]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """Atomically: a temp file, flushed to disk, renamed (a crash leaves the old file or none, never half)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def run_shards(out: Path, sources: list[Source], generate, sampling: SamplingSettings, rows_per_shard: int,
               shards: list[int], progress: bool = True) -> Summary:
    """Regenerate ``shards`` (this rank's share of the missing ones); returns what was done.

    A shard is written when every row is regenerated or failed permanently (those rows go to its
    ``.failed.jsonl`` with the reason); a transient failure leaves the shard for the next run."""
    summary = Summary()
    rows_todo = sum(len(sources[k * rows_per_shard:(k + 1) * rows_per_shard]) for k in shards)
    bar = progress_bar(total=rows_todo, unit="row", disable=not progress, dynamic_ncols=True,
               desc=f"regenerating {len(shards)} shards")
    start = time.perf_counter()
    for k in shards:
        chunk = sources[k * rows_per_shard:(k + 1) * rows_per_shard]
        rows, failures = regenerate_rows(chunk, generate, sampling)
        bar.update(len(chunk))
        retry_later = [(src, f) for src, f in failures if not f.permanent]
        summary.failed += [f"{src.file} row {src.row}: {f.reason}" + ("" if f.permanent else " (retried on the next run)")
                           for src, f in failures]
        if retry_later:
            continue
        if failures:
            write_jsonl(shard_path(out, k, failed=True), [{"source": {"file": src.file, "row": src.row}, "reason": f.reason}
                                                          for src, f in failures])
        write_jsonl(shard_path(out, k), rows)
        for row in rows:
            summary.add(row)
        summary.seconds = time.perf_counter() - start
        bar.set_postfix_str(f"{summary.tokens / max(summary.seconds, 1e-9):.0f} tok/s", refresh=False)
    bar.close()
    summary.seconds = time.perf_counter() - start
    return summary


def concatenate(out: Path, n_rows: int, rows_per_shard: int) -> Summary | None:
    """Write regenerated.jsonl (and failed.jsonl, the rows that failed for good) from every shard, in
    order; returns the summary of the whole output, or None while a shard is missing."""
    if missing_shards(out, n_rows, rows_per_shard):
        return None
    n_shards = (n_rows + rows_per_shard - 1) // rows_per_shard
    summary = Summary()
    final, failed = out / "regenerated.jsonl", out / "failed.jsonl"
    rows = [json.loads(line) for k in range(n_shards) for line in shard_path(out, k).read_text().splitlines()]
    lost = [json.loads(line) for k in range(n_shards) if shard_path(out, k, failed=True).is_file()
            for line in shard_path(out, k, failed=True).read_text().splitlines()]
    for row in rows:
        summary.add(row)
    summary.failed = [f"{x['source']['file']} row {x['source']['row']}: {x['reason']}" for x in lost]
    write_jsonl(failed, lost)
    write_jsonl(final, rows)
    return summary
