"""Shared test helpers: tiny tokenizers with real chat templates, tiny random-init HF models."""

from __future__ import annotations

import os

import torch

# Triton picks interpreter or compiler when a kernel is defined (at import): without a GPU, interpret, so the
# kernels' tests run on CPU. Nothing uses the kernels on CPU unless a test asks (HEADSTART_LOSS_KERNEL=triton).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from headstart.heads.registry import register_head  # noqa: E402
from toy_head.spec import TOY  # noqa: E402

# The toy head (tests/toy_head/): its catalog line. Every test parametrized over the catalog runs it (test_catalog.py).
register_head("toy", TOY)  # noqa: E402

# Real chat templates of different structure (trimmed to the parts that matter for masking).
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Qwen2.5: injects a default system prompt when the conversation has none.
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}"
    "{%- endif %}{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or (message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
# Gemma: no system role (merged into the first user turn), assistant is called "model".
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first_user_prefix = messages[0]['content'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

TEMPLATES = {
    "llama3": (LLAMA3_TEMPLATE, "<|eot_id|>"),
    "chatml": (CHATML_TEMPLATE, "<|im_end|>"),
    "qwen25": (QWEN25_TEMPLATE, "<|im_end|>"),
    "gemma": (GEMMA_TEMPLATE, "<end_of_turn>"),
}
SPECIAL_TOKENS = [
    "<|pad|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "<|im_start|>", "<|im_end|>", "<bos>", "<start_of_turn>", "<end_of_turn>",
]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. What is 12 times 7? It is 84.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "You are a helpful assistant. Please answer the question carefully and briefly.",
    "Natalia sold 48/2 = 24 clips in May. #### 72",
] * 20


def make_tokenizer(template: str, eos: str, vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a few sentences, with ``template`` as its chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    bos = "<bos>" if "<start_of_turn>" in template else "<|begin_of_text|>"
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token="<|pad|>",
                                   chat_template=template)


@pytest.fixture(params=sorted(TEMPLATES))
def chat_tokenizer(request) -> PreTrainedTokenizerFast:
    template, eos = TEMPLATES[request.param]
    return make_tokenizer(template, eos)


@pytest.fixture
def chatml_tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer(CHATML_TEMPLATE, "<|im_end|>")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    # Tests never share (or pollute) the user's tokenization cache.
    monkeypatch.setenv("HEADSTART_CACHE", str(tmp_path / "hs-cache"))
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def llama8_dir(tmp_path_factory):
    """A tiny random 8-layer Llama checkpoint on disk (no tokenizer), shared by the tests that load a target by path."""
    from tiny_models import tiny_causal_lm

    root = tmp_path_factory.mktemp("llama8")
    tiny_causal_lm("llama", num_hidden_layers=8).save_pretrained(root)
    return root

