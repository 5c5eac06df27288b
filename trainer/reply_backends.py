"""Where regenerated replies come from: the target in this process (HF ``generate``) or any
OpenAI-compatible server (vLLM, SGLang, ``transformers serve``) serving it.

Both take a batch of conversation prefixes (each ending with a user turn) and their seeds and return,
per prefix, a ``Reply`` or a ``Failure``. A failure is ``permanent`` when asking again cannot help (the
prompt does not fit the context, the server refuses the request, the target replies with nothing);
otherwise it is transient (the server is down, overloaded, or answered with something unusable) and
the row is retried on the next run.
"""

from __future__ import annotations

import http.client
import json
import random
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
    """Sampling seed; each row and turn draws from a seed derived from it, so a resumed job draws the same."""

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Reply:
    text: str
    finish_reason: str  # stop (the model ended its turn) | length (max_new_tokens reached)
    tokens: int


@dataclass(frozen=True)
class Failure:
    reason: str
    permanent: bool


class ServerDown(RuntimeError):
    """Too many requests in a row failed: stop instead of failing every remaining row."""


class HFBackend:
    """Batched ``generate`` with left padding on the target loaded in this process (one copy per rank:
    the target must fit one device)."""

    def __init__(self, model, tokenizer, sampling: SamplingSettings, batch_size: int = 16) -> None:
        self.model, self.tokenizer, self.sampling, self.batch_size = model, tokenizer, sampling, batch_size
        self.device = next(model.parameters()).device
        tokenizer.padding_side = "left"  # generation continues from the right end of every row
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        config_eos = model.generation_config.eos_token_id
        self.eos = {tokenizer.eos_token_id, *(config_eos if isinstance(config_eos, list) else [config_eos])} - {None}
        self.max_positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)

    @torch.no_grad()
    def generate(self, prefixes: list[list[Message]], seeds: list[int]) -> list[Reply | Failure]:
        s = self.sampling
        texts = [self.tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in prefixes]
        lengths = [len(self.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
        out: list[Reply | Failure | None] = [None] * len(prefixes)
        fits = []
        for i, n in enumerate(lengths):
            if self.max_positions and n + s.max_new_tokens > self.max_positions:
                out[i] = Failure(f"prompt of {n} tokens + {s.max_new_tokens} new ones exceeds the target's "
                                 f"{self.max_positions} positions", permanent=True)
            else:
                fits.append(i)
        fits.sort(key=lambda i: lengths[i])  # similar lengths together: less padding
        for start in range(0, len(fits), self.batch_size):
            chunk = fits[start : start + self.batch_size]
            batch = self.tokenizer([texts[i] for i in chunk], return_tensors="pt", padding=True,
                                   add_special_tokens=False).to(self.device)
            torch.manual_seed(seeds[chunk[0]])  # one stream per batch: the plan records the batch size
            sampled = {"temperature": s.temperature, "top_p": s.top_p} if s.temperature > 0 else {"temperature": None, "top_p": None}
            generated = self.model.generate(
                **batch, max_new_tokens=s.max_new_tokens, do_sample=s.temperature > 0, **sampled, top_k=None,
                repetition_penalty=1.0, pad_token_id=self.tokenizer.pad_token_id, eos_token_id=sorted(self.eos))
            for i, ids in zip(chunk, generated[:, batch["input_ids"].shape[1]:].tolist()):
                end = next((k for k, t in enumerate(ids) if t in self.eos), None)
                kept = ids if end is None else ids[:end]
                text = self.tokenizer.decode(kept, skip_special_tokens=True).strip()
                out[i] = (Reply(text, "length" if end is None else "stop", len(kept) + (end is not None)) if text
                          else Failure("the target's reply is empty", permanent=True))
        return out  # type: ignore[return-value]


class OpenAIBackend:
    """Chat completions from an OpenAI-compatible server, ``concurrency`` requests at a time.

    Connection errors, timeouts, 408, 429, 5xx and unusable answers (malformed JSON, no choices, a
    finish reason other than stop/length) are retried with capped, jittered exponential back-off;
    other 4xx and empty replies are permanent failures of the row. ``max_consecutive_failures``
    requests failing in a row stop the job (``ServerDown``) rather than failing every row in turn."""

    def __init__(self, endpoint: str, model: str, sampling: SamplingSettings, concurrency: int = 8, retries: int = 5,
                 backoff: float = 1.0, timeout: float = 600.0, api_key: str | None = None,
                 max_consecutive_failures: int = 64) -> None:
        base = endpoint.rstrip("/")
        self.url = base + ("" if base.endswith("/v1") else "/v1") + "/chat/completions"
        self.model, self.sampling, self.concurrency = model, sampling, concurrency
        self.retries, self.backoff, self.timeout, self.api_key = retries, backoff, timeout, api_key
        self.max_consecutive_failures, self._failures_in_a_row = max_consecutive_failures, 0
        self.pool = ThreadPoolExecutor(concurrency)

    def _once(self, body: bytes) -> tuple[Reply | None, str, bool]:
        """(reply, why not, retry?) of one request."""
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})}
        try:
            with urllib.request.urlopen(urllib.request.Request(self.url, body, headers, method="POST"),
                                        timeout=self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            try:
                detail = err.read()[:300].decode(errors="replace")
            except Exception:  # the error body itself may be cut off
                detail = ""
            return None, f"HTTP {err.code}: {detail}", err.code in (408, 429) or err.code >= 500
        except (OSError, http.client.HTTPException) as err:  # refused, reset, timeout, TLS, incomplete read
            return None, f"{type(err).__name__}: {err}", True
        try:
            choice = json.loads(raw)["choices"][0]
            text = (choice["message"].get("content") or "").strip()
            finish, usage = choice.get("finish_reason"), json.loads(raw).get("usage") or {}
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as err:
            return None, f"unusable answer ({type(err).__name__}: {raw[:200]!r})", True
        if finish not in ("stop", "length", "eos"):
            return None, f"finish_reason {finish!r} (aborted or filtered)", True
        if not text:
            return None, "empty reply (a reasoning parser or tool call on the server?)", False
        return Reply(text, "length" if finish == "length" else "stop", int(usage.get("completion_tokens") or 0)), "", False

    def _request(self, messages: list[Message], seed: int) -> Reply | Failure:
        s = self.sampling
        body = json.dumps({"model": self.model, "messages": messages, "max_tokens": s.max_new_tokens,
                           "temperature": s.temperature, "top_p": s.top_p, "seed": seed, "stream": False}).encode()
        why, retry = "", True
        for attempt in range(self.retries + 1):
            if attempt:  # capped exponential back-off with jitter, so many threads do not retry in lockstep
                time.sleep(min(60.0, self.backoff * 2 ** (attempt - 1)) * random.uniform(0.5, 1.5))
            reply, why, retry = self._once(body)
            if reply is not None:
                self._failures_in_a_row = 0
                return reply
            if not retry:
                return Failure(why, permanent=True)
        self._failures_in_a_row += 1
        if self._failures_in_a_row >= self.max_consecutive_failures:
            raise ServerDown(f"{self._failures_in_a_row} requests in a row failed; last: {why}. Is {self.url} up?")
        return Failure(f"{self.url}: {why} (after {self.retries + 1} attempts)", permanent=False)

    def generate(self, prefixes: list[list[Message]], seeds: list[int]) -> list[Reply | Failure]:
        return list(self.pool.map(self._request, prefixes, seeds))
