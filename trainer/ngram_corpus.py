"""The drafters' datastores from conversation files, rendered with the target's chat template as the trainer renders
them: n-gram lookup's counts of their assistant turns (decode/ngram_store.py) and REST's suffix array over whole
conversations (decode/rest.py)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from transformers import PreTrainedTokenizerBase

from headstart.decode.ngram_store import NgramStore
from headstart.decode.rest import Datastore, vocab_fingerprint
from headstart.trainer.chat import tokenize_conversation
from headstart.trainer.conversations import RowError, detect_format, to_messages
from headstart.trainer.data import read_rows


def tokenized_conversations(paths: Iterable[str], tokenizer: PreTrainedTokenizerBase, what: str) -> Iterator:
    """Each conversation of each file (any format the trainer reads, ``file[a:b]`` row ranges included), tokenized as
    the target sees it. A file with no usable conversation is an error that names it (``what``: the datastore it is
    for); single bad rows are skipped."""
    for path in paths:
        rows, used = read_rows(path), 0
        try:
            fmt = detect_format(rows[0]) if len(rows) else None
        except RowError as err:
            raise ValueError(f"{path}: {err}") from err
        if fmt == "text":
            raise ValueError(f"{path}: {what} reads conversations (their assistant turns), not 'text' rows")
        for row in rows:
            try:
                tok = tokenize_conversation(tokenizer, to_messages(row, fmt))
            except RowError:
                continue
            used += 1
            yield tok
        if not used:
            raise ValueError(f"{path}: no conversation with an assistant turn for {what}")


def ngram_store_from_conversations(paths: Iterable[str], tokenizer: PreTrainedTokenizerBase, max_ngram: int = 4,
                                   min_ngram: int = 2) -> NgramStore:
    """Count the assistant turns of conversation files (only what follows into them: what the target says)."""
    store = NgramStore(max_ngram, min_ngram)
    for tok in tokenized_conversations(paths, tokenizer, "an n-gram store"):
        store.add(tok.input_ids, tok.loss_mask)
    return store


def datastore_from_conversations(paths: Iterable[str], tokenizer: PreTrainedTokenizerBase) -> Datastore:
    """REST's datastore: every conversation whole (template, user and assistant turns), one sequence each."""
    paths = list(paths)
    sequences = [list(tok.input_ids) for tok in tokenized_conversations(paths, tokenizer, "a REST datastore")]
    return Datastore.build(sequences, {"sources": paths, "vocab_size": len(tokenizer),
                                       "vocab_fingerprint": vocab_fingerprint(tokenizer)})
