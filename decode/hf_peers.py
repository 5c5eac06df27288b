"""The speculative decoding a user already has: transformers' own assisted generation and prompt lookup, run
on the same prompts, target and token budget as headstart's drafters, so the benchmark compares them in one run.

``HFSpeculation(model, k, assistant=...)`` or ``HFSpeculation(model, k, prompt_lookup=True)`` is called like
``speculative_generate`` and returns a ``Generation``. transformers does not report accepted drafts per round,
but it calls the target once per round: a forward hook counts the calls. tau = tokens per target forward:
headstart's loops run the prompt alone (its forward yields the first token, which tau leaves out with that
forward); transformers' first call runs the prompt together with the first round's drafts when it has any
(assisted generation always; prompt lookup when the prompt matches itself), so every token and every call count
(``Generation.prefill_counted``): plain decoding is 1.0 either way, and a draft accepting everything k + 1.
Acceptance by position is not available (the rounds' lengths are not exposed).
"""

from __future__ import annotations

import warnings

import torch
from transformers import PreTrainedModel
from transformers.utils import is_sklearn_available

from headstart.decode.clock import UNTIMED, RoundClock
from headstart.decode.generate import Generation, Sampling


class HFSpeculation:
    def __init__(self, model: PreTrainedModel, k: int, assistant: PreTrainedModel | None = None,
                 prompt_lookup: bool = False, pad_token_id: int = 0, confidence_threshold: float = 0.0) -> None:
        """``confidence_threshold``: assisted generation's ``assistant_confidence_threshold`` (0: no early stop of a
        draft; transformers' own default is 0.4, which it also tunes as it goes when scikit-learn is installed)."""
        if (assistant is None) == (not prompt_lookup):
            raise ValueError("HFSpeculation runs either assisted generation (assistant=) or prompt lookup, one of them")
        self.model, self.k, self.assistant, self.prompt_lookup, self.pad = model, k, assistant, prompt_lookup, pad_token_id
        if assistant is not None:
            # A fixed k, as headstart's chains: transformers' default grows and shrinks it by a heuristic.
            assistant.generation_config.num_assistant_tokens = k
            assistant.generation_config.num_assistant_tokens_schedule = "constant"
            assistant.generation_config.assistant_confidence_threshold = confidence_threshold
            if confidence_threshold and is_sklearn_available():
                warnings.warn("scikit-learn is installed: transformers retunes assistant_confidence_threshold as it "
                              f"goes, so assisted generation does not keep {confidence_threshold} (headstart's drafters do)")
        self.calls, self.first_input = 0, 0

    def _count(self, module, args, kwargs, output) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if self.calls == 0 and ids is not None:
            self.first_input = ids.shape[-1]
        self.calls += 1

    @torch.no_grad()
    def __call__(self, prompt_ids: torch.Tensor, max_new_tokens: int, eos_ids: set[int],
                 sampling: Sampling | None = None, generator: torch.Generator | None = None,
                 clock: RoundClock | None = None) -> Generation:
        """Greedy only: assisted generation's sampling is its own rejection rule, not comparable here."""
        if sampling is not None:
            raise ValueError("the transformers peers are benchmarked greedy (--temperature 0)")
        clock = clock or UNTIMED
        clock.start()
        self.calls = 0
        extra = {"assistant_model": self.assistant} if self.assistant is not None else {"prompt_lookup_num_tokens": self.k}
        hook = self.model.register_forward_hook(self._count, with_kwargs=True)  # only during this call: plain runs
        try:                                                                      # on the same model stay uncounted
            out = self.model.generate(prompt_ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=self.pad,
                                      eos_token_id=sorted(eos_ids) or None, attention_mask=torch.ones_like(prompt_ids),
                                      **extra)
        finally:
            hook.remove()
        clock.lap("other")  # one call: transformers' loop cannot be split by part from outside
        tokens = out[0, prompt_ids.shape[1]:].tolist()
        for i, t in enumerate(tokens):  # headstart's rule: cut at the first EOS, kept
            if t in eos_ids:
                tokens = tokens[: i + 1]
                break
        if self.first_input <= prompt_ids.shape[1]:  # the first call verified no drafts: headstart's prefill
            return Generation(tokens, target_forwards=max(0, self.calls - 1))
        return Generation(tokens, target_forwards=self.calls, prefill_counted=True)
