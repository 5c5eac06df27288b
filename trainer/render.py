"""Show a tokenized example with its trained tokens marked, so a user can check the loss mask."""

from __future__ import annotations

from itertools import groupby

from transformers import PreTrainedTokenizerBase

_GREEN, _RESET = "\033[1;32m", "\033[0m"


def highlight_trained(
    tokenizer: PreTrainedTokenizerBase, input_ids: list[int], loss_mask: list[int], color: bool = False
) -> str:
    """Decode ``input_ids``; trained runs in bold green (``color``) or wrapped in ``[[ ]]``."""
    pieces, pos = [], 0
    for trained, run in groupby(loss_mask):
        n = len(list(run))
        text = tokenizer.decode(input_ids[pos : pos + n], skip_special_tokens=False)
        pos += n
        if trained:
            text = f"{_GREEN}{text}{_RESET}" if color else f"[[{text}]]"
        pieces.append(text)
    return "".join(pieces)
