"""What a decode run asks and starts from: Spec-Bench-format questions (read, chosen by category), the prompt of a
conversation so far, and the run's setup (device, dtype, target, tokenizer, questions, end-of-sequence ids)."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from headstart.models.target import Target, TargetConfig, load_tokenizer


def read_questions(path: str | Path) -> list[dict]:
    """Spec-Bench-format questions (JSONL, one ``{"turns": [str, ...]}`` object a line), refused by file and line."""
    path, rows = Path(path), []
    if not path.is_file():
        raise FileNotFoundError(f"--questions {path}: " + ("a directory, not a file" if path.is_dir() else "no such file"))
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        line = path.read_bytes()[:err.start].count(b"\n") + 1
        raise ValueError(f"{path} line {line}: not UTF-8 text ({err.reason}); save the file as UTF-8") from None
    shape = "expected 'turns': [str, ...] in one JSON object a line (Spec-Bench format)"
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            raise ValueError(f"{path} line {i + 1}: not JSON ({err}); {shape}") from None
        if not isinstance(row, dict) or not isinstance(row.get("turns"), list) or not row["turns"] \
                or not all(isinstance(t, str) for t in row["turns"]):
            raise ValueError(f"{path} line {i + 1}: {shape}")
        rows.append({"question_id": row.get("question_id", i), "category": row.get("category", "all"), "turns": row["turns"]})
    if not rows:
        raise ValueError(f"{path}: no questions (the file is empty); expected 'turns': [str, ...] in one JSON object "
                         "a line (Spec-Bench format)")
    return rows


def first_per_category(questions: list[dict], n: int) -> list[dict]:
    """The first n questions of each category, in file order."""
    counts: dict[str, int] = defaultdict(int)
    chosen = []
    for q in questions:
        if counts[q["category"]] < n:
            chosen.append(q)
            counts[q["category"]] += 1
    return chosen


def prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> torch.Tensor:
    """The prompt [1, T] for a conversation so far: through the tokenizer's chat template, or -- a base model has
    none -- the turns' texts joined by blank lines, tokenized as a plain prompt (with the BOS the tokenizer adds)."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)["input_ids"]
    text = "\n\n".join(m["content"] for m in messages) + "\n\n"
    return tokenizer(text, return_tensors="pt")["input_ids"]


@dataclass
class DecodeSetup:
    device: str
    dtype: str
    target: Target
    tokenizer: PreTrainedTokenizerBase
    questions: list[dict]
    eos: set[int]


def default_dtype(device: str) -> str:
    """A run's dtype when none is given: bfloat16 on a GPU, float32 on a CPU."""
    return "bfloat16" if device == "cuda" else "float32"


def decode_setup(target_path: str, dtype: str | None, questions_path: str | None, limit: int | None = None,
                 per_category: int | None = None) -> DecodeSetup:
    """What a decode run starts from: the device (a GPU when there is one), the dtype (``default_dtype``), the target
    and its tokenizer, the questions (the first ``per_category`` of each category, then the first ``limit`` of those;
    none without ``questions_path``) and the end-of-sequence ids of tokenizer and generation config."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = dtype or default_dtype(device)
    target = Target.from_pretrained(TargetConfig(path=target_path, dtype=dtype, device=device))
    tokenizer = load_tokenizer(target_path)
    questions = read_questions(questions_path) if questions_path else []
    if per_category:  # before the limit: --per-category 1 --limit 3 is the first question of three categories
        questions = first_per_category(questions, per_category)
    questions = questions[:limit]
    eos = {t for t in [tokenizer.eos_token_id, target.model.generation_config.eos_token_id] if isinstance(t, int)}
    return DecodeSetup(device, dtype, target, tokenizer, questions, eos)
