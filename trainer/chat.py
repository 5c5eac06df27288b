"""Chat template rendering and the assistant-only loss mask.

The mask is derived from the tokenizer's own chat template, for any template, by prefix renders:
for assistant turn i, ``render(messages[:i], add_generation_prompt=True)`` ends exactly where the
assistant's tokens begin, and ``render(messages[:i+1])`` ends right after its end-of-turn token.
Those two character offsets bound the trained span; token offsets from the fast tokenizer turn
character spans into a token mask. Template headers, system prompts the template injects, and
user turns are therefore never trained on, whatever the template looks like.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from headstart.trainer.conversations import Message, RowError


@dataclass(frozen=True)
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on tokens the head is trained to predict (assistant turns)


def require_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer at {tokenizer.name_or_path!r} has no chat template, which conversation data "
            "needs; use a chat/instruct tokenizer, or preformatted 'text' rows"
        )


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[Message], add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as err:  # jinja raises TemplateError / raise_exception(...) for unsupported roles
        raise RowError(f"the chat template rejected the conversation: {err}") from err


def assistant_char_spans(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], last_turn_only: bool = False
) -> tuple[str, list[tuple[int, int]]]:
    """Render ``messages`` and return (text, [(start, end) character span of each assistant turn])."""
    text = _render(tokenizer, messages, add_generation_prompt=False)
    spans = []
    assistant_turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if last_turn_only:
        assistant_turns = assistant_turns[-1:]
    for i in assistant_turns:
        before = _render(tokenizer, messages[:i], add_generation_prompt=True)
        through = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not (text.startswith(before) and text.startswith(through)):
            raise RowError(
                "the chat template renders earlier turns differently once later turns follow "
                "(e.g. it strips reasoning from past turns); use last_turn_only, or preformatted text rows"
            )
        # Keep the end-of-turn token but not the newline some templates print after it.
        end = len(through.rstrip())
        spans.append((len(before), max(end, len(before))))
    return text, spans


def tokenize_with_mask(
    tokenizer: PreTrainedTokenizerBase, text: str, spans: list[tuple[int, int]] | None, max_length: int | None
) -> Tokenized:
    """Tokenize ``text``; a token is trained when its first character lies in one of ``spans``.

    ``spans=None`` trains on every token (preformatted text without markers).
    """
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    if spans is None:
        mask = [1] * len(ids)
    else:
        mask = [0] * len(ids)
        span_iter = iter(sorted(spans))
        span = next(span_iter, None)
        for t, (start, end) in enumerate(enc["offset_mapping"]):
            while span is not None and start >= span[1]:
                span = next(span_iter, None)
            if span is None:
                break
            if end > start and span[0] <= start < span[1]:
                mask[t] = 1
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return Tokenized(ids, mask)


def marker_spans(text: str, start_marker: str, end_marker: str) -> list[tuple[int, int]]:
    """Spans of preformatted text from the end of each ``start_marker`` through its ``end_marker``."""
    spans, pos = [], 0
    while (begin := text.find(start_marker, pos)) != -1:
        begin += len(start_marker)
        stop = text.find(end_marker, begin)
        end = len(text) if stop == -1 else stop + len(end_marker)
        spans.append((begin, end))
        pos = end
    return spans


def tokenize_text(tokenizer: PreTrainedTokenizerBase, text: str, spans: list[tuple[int, int]] | None) -> Tokenized:
    """A preformatted 'text' row as the target sees a prompt: with the special tokens ``tokenizer(text)`` puts
    before it (Llama's and Gemma's BOS; Qwen adds none), untrained, unless the text already starts with them.
    A base model run without its BOS gives other hidden states (Gemma's drift far), so the features would not be
    the ones decoding sees."""
    tok = tokenize_with_mask(tokenizer, text, spans, None)
    plain = tokenizer("x", add_special_tokens=False)["input_ids"]
    full = tokenizer("x")["input_ids"]
    prefix = full[: full.index(plain[0])] if plain and plain[0] in full else []
    if not prefix or tok.input_ids[: len(prefix)] == prefix:
        return tok
    return Tokenized(prefix + tok.input_ids, [0] * len(prefix) + tok.loss_mask)


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[Message],
    max_length: int | None = None,
    last_turn_only: bool = False,
) -> Tokenized:
    text, spans = assistant_char_spans(tokenizer, messages, last_turn_only)
    return tokenize_with_mask(tokenizer, text, spans, max_length)
