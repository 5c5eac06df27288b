"""Where regenerated replies come from: the target in this process (HF ``generate``) or any
OpenAI-compatible server (vLLM, SGLang, ``transformers serve``) serving it.

Both take a batch of conversation prefixes (each ending with a user turn) and return one ``Reply``
per prefix. The sampling settings are the same on both: greedy at temperature 0, else temperature
and top-p.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import torch

Message = dict[str, str]


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 0.0
    """0 = greedy."""
    top_p: float = 1.0
    max_new_tokens: int = 1024
    seed: int = 0
    """Sampling seed; each shard of rows draws from seed + its index, so a resumed job regenerates the same."""

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Reply:
    text: str
    finish_reason: str  # stop (the model ended its turn) | length (max_new_tokens reached)
    tokens: int


class RowFailed(RuntimeError):
    """A request that kept failing after its retries; the caller names the row."""


class HFBackend:
    """Batched ``generate`` with left padding on the target loaded in this process."""

    def __init__(self, model, tokenizer, sampling: SamplingSettings, batch_size: int = 16) -> None:
        self.model, self.tokenizer, self.sampling, self.batch_size = model, tokenizer, sampling, batch_size
        self.device = next(model.parameters()).device
        tokenizer.padding_side = "left"  # generation continues from the right end of every row
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        config_eos = model.generation_config.eos_token_id
        self.eos = {tokenizer.eos_token_id, *(config_eos if isinstance(config_eos, list) else [config_eos])} - {None}

    def describe(self) -> dict:
        return {"backend": "hf", "batch_size": self.batch_size}

    @torch.no_grad()
    def generate(self, prefixes: list[list[Message]], seed: int) -> list[Reply]:
        replies: list[Reply] = []
        for start in range(0, len(prefixes), self.batch_size):
            chunk = prefixes[start : start + self.batch_size]
            texts = [self.tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in chunk]
            batch = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
            s = self.sampling
            torch.manual_seed(seed + start)
            out = self.model.generate(
                **batch, max_new_tokens=s.max_new_tokens, do_sample=s.temperature > 0,
                **({"temperature": s.temperature, "top_p": s.top_p} if s.temperature > 0 else {"temperature": None, "top_p": None}),
                pad_token_id=self.tokenizer.pad_token_id, eos_token_id=sorted(self.eos), top_k=None)
            new = out[:, batch["input_ids"].shape[1]:].tolist()
            for ids in new:
                end = next((i for i, t in enumerate(ids) if t in self.eos), None)
                kept = ids if end is None else ids[:end]
                replies.append(Reply(self.tokenizer.decode(kept, skip_special_tokens=True).strip(),
                                     "length" if end is None else "stop", len(kept) + (end is not None)))
        return replies


class OpenAIBackend:
    """Chat completions from an OpenAI-compatible server, ``concurrency`` requests at a time.

    Connection errors, timeouts, 429 and 5xx are retried with exponential back-off (``retries``
    times); other 4xx are the request's fault and fail at once. A request that keeps failing raises
    ``RowFailed``; nothing of its row is written."""

    def __init__(self, endpoint: str, model: str, sampling: SamplingSettings, concurrency: int = 8, retries: int = 5,
                 backoff: float = 1.0, timeout: float = 600.0, api_key: str | None = None) -> None:
        self.url = endpoint.rstrip("/") + ("" if endpoint.rstrip("/").endswith("/v1") else "/v1") + "/chat/completions"
        self.model, self.sampling, self.concurrency = model, sampling, concurrency
        self.retries, self.backoff, self.timeout, self.api_key = retries, backoff, timeout, api_key

    def describe(self) -> dict:
        return {"backend": "openai", "endpoint": self.url, "model": self.model}

    def _post(self, messages: list[Message], seed: int) -> Reply:
        s = self.sampling
        body = {"model": self.model, "messages": messages, "max_tokens": s.max_new_tokens, "temperature": s.temperature,
                "top_p": s.top_p, "seed": seed, "stream": False}
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})}
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            request = urllib.request.Request(self.url, json.dumps(body).encode(), headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    data = json.loads(response.read())
            except urllib.error.HTTPError as err:
                last = f"HTTP {err.code}: {err.read()[:200].decode(errors='replace')}"
                if err.code != 429 and err.code < 500:
                    break  # the request itself is wrong: retrying will not help
                continue
            except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
                last = f"{type(err).__name__}: {err}"
                continue
            choice = data["choices"][0]
            usage = data.get("usage") or {}
            finish = "length" if choice.get("finish_reason") == "length" else "stop"
            return Reply((choice["message"].get("content") or "").strip(), finish, int(usage.get("completion_tokens") or 0))
        raise RowFailed(f"{self.url} failed after {attempt + 1} attempt(s): {last}")

    def generate(self, prefixes: list[list[Message]], seed: int) -> list[Reply]:
        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(lambda im: self._post(im[1], seed + im[0]), enumerate(prefixes)))
