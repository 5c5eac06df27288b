"""A server's request log -> the conversations it served, for ``headstart adapt``.

One JSON object a line, either

- an OpenAI chat completion as served: ``{"request": {"messages": [...]}, "response": {"choices": [{"message":
  {"role": "assistant", "content": "..."}}]}}`` -- every choice is a served reply. Where the server returned token ids
  (vLLM's ``return_token_ids``: ``response.prompt_token_ids`` and ``choices[i].token_ids``), they are checked against
  the target's tokenizer and chat template: a log served under another template or tokenizer is refused by line, as
  a head trained on it would learn another model's inputs;
- or a conversation already (``{"messages": [...]}`` ending with the assistant's reply), as headstart's own data.

A line that is neither, or whose messages are malformed, is refused with its line number; nothing is skipped silently.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from headstart.decode.questions import prompt_ids
from headstart.trainer.conversations import Message, validate


class LogError(ValueError):
    """A request log that cannot be read as served conversations (names the file and line)."""


def served_conversations(path: str | Path, tokenizer: PreTrainedTokenizerBase) -> list[list[Message]]:
    """Every served conversation of the log at ``path`` (prompt messages, then the served reply), in order."""
    path = Path(path)
    if not path.is_file():
        raise LogError(f"--log {path}: no such file")
    conversations: list[list[Message]] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise LogError(f"{where}: not JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise LogError(f"{where}: a JSON object per line, got {type(row).__name__}")
        try:
            found = _from_completion(row, tokenizer, where) if "request" in row else _from_messages(row, where)
            for messages in found:
                validate(messages)
        except (KeyError, TypeError, ValueError) as err:
            if isinstance(err, LogError):
                raise
            raise LogError(f"{where}: {err}") from None
        conversations += found
    if not conversations:
        raise LogError(f"{path}: no served conversation in it")
    return conversations


def _from_messages(row: dict[str, Any], where: str) -> list[list[Message]]:
    if "messages" not in row:
        raise LogError(f"{where}: neither an OpenAI chat completion ('request' and 'response') nor a conversation "
                       f"('messages'); its keys: {sorted(row)}")
    messages = [dict(m) for m in row["messages"]]
    if not messages or messages[-1].get("role") != "assistant":
        raise LogError(f"{where}: a conversation ends with the served assistant reply")
    return [messages]


def _from_completion(row: dict[str, Any], tokenizer: PreTrainedTokenizerBase, where: str) -> list[list[Message]]:
    request, response = row["request"], row.get("response")
    if not isinstance(response, dict) or not response.get("choices"):
        raise LogError(f"{where}: no served reply ('response.choices' is missing or empty: a failed request?)")
    prompt = [{"role": m["role"], "content": m["content"]} for m in request["messages"]]
    if "prompt_token_ids" in response:
        _check_prompt(prompt, response["prompt_token_ids"], tokenizer, where)
    found = []
    for i, choice in enumerate(response["choices"]):
        reply = choice["message"]["content"]
        if not isinstance(reply, str) or not reply:
            raise LogError(f"{where}: choice {i} has no text content")
        if "token_ids" in choice:
            _check_reply(reply, choice["token_ids"], tokenizer, f"{where} choice {i}")
        found.append([*prompt, {"role": "assistant", "content": reply}])
    return found


def _check_prompt(prompt: list[Message], served: list[int], tokenizer: PreTrainedTokenizerBase, where: str) -> None:
    mine = prompt_ids(tokenizer, prompt)[0].tolist()
    if mine != list(served):
        at = next((i for i, (a, b) in enumerate(zip(mine, served)) if a != b), min(len(mine), len(served)))
        raise LogError(f"{where}: the served prompt's token ids differ from what the target's tokenizer and chat template "
                       f"make of its messages (first at token {at}: served {served[at:at + 3]}, here {mine[at:at + 3]}; "
                       f"{len(served)} against {len(mine)} tokens): the log was served with another tokenizer or chat "
                       "template, and a head adapted to it would learn another model's inputs")


def _check_reply(reply: str, served: list[int], tokenizer: PreTrainedTokenizerBase, where: str) -> None:
    text = tokenizer.decode(served, skip_special_tokens=True)
    if text.strip() != reply.strip():
        raise LogError(f"{where}: the reply's token ids do not decode to its text under the target's tokenizer (they "
                       f"give {text[:40]!r}..., the text is {reply[:40]!r}...): the log was served with another tokenizer")
