"""A complete tiny training setup on disk: target checkpoint + tokenizer, chat data, overrides."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import CHATML_TEMPLATE, make_tokenizer
from tiny_models import tiny_causal_lm

from headstart.heads.registry import HEADS

QUESTIONS = ["What is 2+3?", "Name a colour.", "Say hello.", "Count to three.", "What is 12 times 7?", "Write add(a, b)."]
ANSWERS = ["2+3 = 5. The answer is 5.", "Blue is a colour.", "Hello there!", "One, two, three.", "12 times 7 is 84.",
           "def add(a, b):\n    return a + b"]


def make_setup(root: Path, rows: int = 24, layers: int = 8, head: str = "eagle3") -> list[str]:
    """Write a tiny Llama target with a ChatML tokenizer and a chat JSONL; return CLI overrides training ``head``."""
    tokenizer = make_tokenizer(CHATML_TEMPLATE, "<|im_end|>")
    target_dir = root / "target"
    model = tiny_causal_lm("llama", num_hidden_layers=layers, vocab_size=len(tokenizer))
    model.save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    data = root / "chat.jsonl"
    with data.open("w") as f:
        for i in range(rows):
            q, a = QUESTIONS[i % len(QUESTIONS)], ANSWERS[i % len(ANSWERS)]
            f.write(json.dumps({"messages": [{"role": "user", "content": f"{q} ({i})"},
                                             {"role": "assistant", "content": a}]}) + "\n")
    return [
        f"--output_dir={root / 'run'}",
        f"--target.path={target_dir}",
        "--target.dtype=float32",
        f"--data.files=[{data}]",
        "--data.max_length=48",
        f"--data.cache_dir={root / 'cache'}",
        f"--draft.head={head}",
        *[f"--draft.{k}={v}" for k, v in HEADS[head].tiny.items()],  # its small instance
        "--train.lr=1e-3",
        "--train.max_steps=6",
        "--train.batch_size=2",
        "--train.save_every=3",
        "--train.log_every=1",  # a train row per step: the tests compare runs step by step
        "--train.eval_fraction=0.2",
        "--train.max_eval_batches=2",
        "--logging.progress=false",
    ]


def train_losses(metrics_path: Path) -> list[float]:
    records = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    return [r["loss"] for r in records if r["split"] == "train"]
