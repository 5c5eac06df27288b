"""The assistant-only loss mask, checked by decoding the trained tokens of real chat templates."""

from __future__ import annotations

import pytest

from headstart.trainer.chat import marker_spans, tokenize_conversation, tokenize_with_mask
from headstart.trainer.conversations import RowError

CONVERSATION = [
    {"role": "system", "content": "You are a terse math tutor."},
    {"role": "user", "content": "What is 12 times 7?"},
    {"role": "assistant", "content": "12 times 7 is 84."},
    {"role": "user", "content": "And divided by 2?"},
    {"role": "assistant", "content": "84/2 = 42.\nSo the answer is 42 ✓"},
]


def trained_runs(tokenizer, tok) -> list[str]:
    """Decode each contiguous run of loss_mask == 1."""
    runs, current = [], []
    for token, m in zip(tok.input_ids, tok.loss_mask):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(r, skip_special_tokens=False) for r in runs]


def test_mask_is_exactly_assistant_turns_and_end_of_turn(chat_tokenizer):
    tok = tokenize_conversation(chat_tokenizer, CONVERSATION)
    eot = chat_tokenizer.eos_token
    expected = [m["content"] + eot for m in CONVERSATION if m["role"] == "assistant"]
    assert trained_runs(chat_tokenizer, tok) == expected
    # Nothing of the system prompt, user turns or headers is trained.
    assert 0 < sum(tok.loss_mask) < len(tok.loss_mask)
    assert tok.input_ids == chat_tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"]


def test_default_system_prompt_is_not_trained(chat_tokenizer):
    conversation = CONVERSATION[1:]  # no system turn: the Qwen2.5 template injects its own
    tok = tokenize_conversation(chat_tokenizer, conversation)
    text = chat_tokenizer.decode(tok.input_ids, skip_special_tokens=False)
    runs = trained_runs(chat_tokenizer, tok)
    assert all("Alibaba" not in r and "times 7?" not in r for r in runs)
    assert len(runs) == 2
    if "Qwen" in (chat_tokenizer.chat_template or ""):
        assert "You are Qwen" in text


def test_last_turn_only(chat_tokenizer):
    tok = tokenize_conversation(chat_tokenizer, CONVERSATION, last_turn_only=True)
    assert trained_runs(chat_tokenizer, tok) == [CONVERSATION[-1]["content"] + chat_tokenizer.eos_token]


def test_truncation_keeps_mask_aligned(chatml_tokenizer):
    full = tokenize_conversation(chatml_tokenizer, CONVERSATION)
    short = tokenize_conversation(chatml_tokenizer, CONVERSATION, max_length=20)
    assert len(short.input_ids) == 20
    assert short.input_ids == full.input_ids[:20] and short.loss_mask == full.loss_mask[:20]


def test_template_rejection_becomes_row_error():
    from conftest import GEMMA_TEMPLATE, make_tokenizer

    gemma = make_tokenizer(GEMMA_TEMPLATE, "<end_of_turn>")
    with pytest.raises(RowError, match="chat template rejected"):
        # Two user turns in a row: Gemma's template raises.
        tokenize_conversation(gemma, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                                      {"role": "assistant", "content": "c"}])


def test_text_rows_with_and_without_markers(chatml_tokenizer):
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello there<|im_end|>\n"
    everything = tokenize_with_mask(chatml_tokenizer, text, None, None)
    assert all(everything.loss_mask)
    spans = marker_spans(text, "<|im_start|>assistant\n", "<|im_end|>")
    marked = tokenize_with_mask(chatml_tokenizer, text, spans, None)
    assert trained_runs(chatml_tokenizer, marked) == ["hello there<|im_end|>"]


def test_text_rows_start_with_the_bos_the_tokenizer_adds(chatml_tokenizer):
    """A base model's prompt is tokenizer(text): with its BOS. Text rows get it too (untrained), once."""
    import copy

    from tokenizers import processors

    from headstart.trainer.chat import tokenize_text

    plain = tokenize_text(chatml_tokenizer, "hello there", None)  # this tokenizer adds nothing
    assert plain.input_ids == chatml_tokenizer("hello there", add_special_tokens=False)["input_ids"]
    with_bos = copy.deepcopy(chatml_tokenizer)
    with_bos.bos_token = "<|im_start|>"
    bos = with_bos.convert_tokens_to_ids("<|im_start|>")
    with_bos._tokenizer.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)])
    tok = tokenize_text(with_bos, "hello there", None)
    assert tok.input_ids == [bos] + plain.input_ids and tok.loss_mask == [0] + [1] * len(plain.input_ids)
    again = tokenize_text(with_bos, "<|im_start|>hello there", None)  # already there: not doubled
    assert again.input_ids.count(bos) == 1 and again.input_ids[0] == bos
