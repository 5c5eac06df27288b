"""n-gram lookup's datastore (decode/ngram_store.py) counted from conversation files: their assistant turns, rendered
with the target's chat template as the trainer renders them."""

from __future__ import annotations

from collections.abc import Iterable

from transformers import PreTrainedTokenizerBase

from headstart.decode.ngram_store import NgramStore
from headstart.trainer.chat import tokenize_conversation
from headstart.trainer.conversations import RowError, detect_format, to_messages
from headstart.trainer.data import read_rows


def ngram_store_from_conversations(paths: Iterable[str], tokenizer: PreTrainedTokenizerBase, max_ngram: int = 4,
                                   min_ngram: int = 2) -> NgramStore:
    """Count the assistant turns of conversation files (any format the trainer reads, ``file[a:b]`` row ranges
    included), rendered with the tokenizer's chat template as the target sees them. A file with no usable
    conversation is an error that names it; single bad rows are skipped."""
    store = NgramStore(max_ngram, min_ngram)
    for path in paths:
        rows, used = read_rows(path), 0
        try:
            fmt = detect_format(rows[0]) if len(rows) else None
        except RowError as err:
            raise ValueError(f"{path}: {err}") from err
        if fmt == "text":
            raise ValueError(f"{path}: an n-gram store reads conversations (whose assistant turns it counts), "
                             "not 'text' rows")
        for row in rows:
            try:
                tok = tokenize_conversation(tokenizer, to_messages(row, fmt))
            except RowError:
                continue
            store.add(tok.input_ids, tok.loss_mask)
            used += 1
        if not used:
            raise ValueError(f"{path}: no conversation with an assistant turn to count")
    return store
