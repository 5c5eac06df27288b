"""Row formats -> one canonical conversation: a list of OpenAI-style ``{role, content}`` messages.

Every supported format is normalised here, so the chat-template and loss-mask code downstream only
ever sees ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``. Validation lives here
too: a bad row raises ``RowError`` with a reason, and the caller adds the file and row number.
"""

from __future__ import annotations

from typing import Any, Callable

Message = dict[str, str]

FORMATS = ("sharegpt", "messages", "instruction", "gsm8k", "text")

# ShareGPT speaker names seen in the wild, mapped to OpenAI roles.
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "system": "system",
}


class RowError(ValueError):
    """A row that cannot be turned into a valid conversation; the message says why."""


def detect_format(row: dict[str, Any]) -> str:
    """Name the row format from the keys of one row (the first row of a file)."""
    keys = set(row)
    if "conversations" in keys:
        turns = row["conversations"]
        first = turns[0] if isinstance(turns, list) and turns else {}
        if isinstance(first, dict) and "from" in first:
            return "sharegpt"
        return "messages"
    if "messages" in keys:
        return "messages"
    if "instruction" in keys and ("output" in keys or "response" in keys):
        return "instruction"
    if "question" in keys and "answer" in keys:
        return "gsm8k"
    if "text" in keys:
        return "text"
    raise RowError(
        f"cannot detect the row format from keys {sorted(keys)}; expected one of: "
        "'conversations' (ShareGPT or messages), 'messages', 'instruction'+'output'/'response', "
        "'question'+'answer', 'text'. Declare it with --format if the keys are unusual."
    )


def _string(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise RowError(f"{what} must be a string, got {type(value).__name__}")
    return value


def _from_sharegpt(row: dict[str, Any]) -> list[Message]:
    turns = row.get("conversations")
    if not isinstance(turns, list):
        raise RowError("'conversations' must be a list of {from, value} turns")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise RowError(f"turn {i} must have 'from' and 'value'")
        speaker = turn["from"]
        if speaker not in _SHAREGPT_ROLES:
            raise RowError(f"turn {i} has unknown speaker {speaker!r} (expected human, gpt or system)")
        messages.append({"role": _SHAREGPT_ROLES[speaker], "content": _string(turn["value"], f"turn {i} 'value'")})
    return messages


def _from_messages(row: dict[str, Any]) -> list[Message]:
    turns = row.get("messages", row.get("conversations"))
    if not isinstance(turns, list):
        raise RowError("'messages' must be a list of {role, content} turns")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
            raise RowError(f"turn {i} must have 'role' and 'content'")
        messages.append({"role": turn["role"], "content": _string(turn["content"], f"turn {i} 'content'")})
    return messages


def _from_instruction(row: dict[str, Any]) -> list[Message]:
    instruction = _string(row.get("instruction"), "'instruction'")
    extra = row.get("input") or ""
    extra = _string(extra, "'input'")
    output = row["output"] if row.get("output") is not None else row.get("response")
    prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": _string(output, "'output'/'response'")}]


def _from_gsm8k(row: dict[str, Any]) -> list[Message]:
    return [
        {"role": "user", "content": _string(row.get("question"), "'question'")},
        {"role": "assistant", "content": _string(row.get("answer"), "'answer'")},
    ]


_CONVERTERS: dict[str, Callable[[dict[str, Any]], list[Message]]] = {
    "sharegpt": _from_sharegpt,
    "messages": _from_messages,
    "instruction": _from_instruction,
    "gsm8k": _from_gsm8k,
}


def validate(messages: list[Message]) -> None:
    """Check roles and their order: an optional system turn, then user/assistant alternating."""
    if not messages:
        raise RowError("the conversation is empty")
    body = messages[1:] if messages[0]["role"] == "system" else messages
    for i, message in enumerate(body):
        offset = i + (len(messages) - len(body))
        role = message["role"]
        if role not in ("user", "assistant", "system"):
            raise RowError(f"turn {offset} has unknown role {role!r} (expected system, user or assistant)")
        expected = "user" if i % 2 == 0 else "assistant"
        if role != expected:
            raise RowError(f"turn {offset} is {role!r} but {expected!r} was expected (system?, then user/assistant alternating)")
        if role == "assistant" and not message["content"].strip():
            raise RowError(f"turn {offset} is an empty assistant turn")
    if not any(m["role"] == "assistant" for m in body):
        raise RowError("the conversation has no assistant turn, so nothing to train on")


def to_messages(row: dict[str, Any], fmt: str) -> list[Message]:
    """Normalise one row of format ``fmt`` (not 'text') to validated messages."""
    if fmt not in _CONVERTERS:
        raise ValueError(f"unknown row format {fmt!r}; choose one of {FORMATS}")
    messages = _CONVERTERS[fmt](row)
    validate(messages)
    return messages
