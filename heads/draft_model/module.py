"""A distilled independent draft model (DistillSpec, Zhou et al., ICLR 2024; AdaSPEC, arXiv 2510.19779): a small causal
LM of the target's family and tokenizer, trained to match the target's next-token distribution.

    q_t = softmax(draft LM(x_0..x_t))         the draft model's own forward over the tokens, as at decoding time
    p_t = softmax(target lm_head(h_t))         the target's distribution (its final hidden state: the feature store's)
    loss = sum over trained t of D(p_t, q_t)   D = draft.loss: kl (forward KL), rkl (reverse KL), tv (total variation),
                                               jsd, lk; or labels=data: cross-entropy to the data's token

It reads nothing of the target at decoding time: the export is a plain Hugging Face causal LM with the target's
tokenizer and generation config, which ``headstart bench --method draft-model``, vLLM's and SGLang's draft-model
speculation and transformers' assisted generation load as they are.

Initialisation (``init``): ``target`` copies the target's embeddings, its first ``num_layers`` decoder layers, its
final norm and lm_head (the model is then the target's family and width, cut short); ``fresh`` starts from random
weights of the target's config with ``num_layers`` layers, or of ``draft.config`` (an HF config.json) for another
shape. AdaSPEC's selective distillation (``filter_reference``): per trained token, the divergence of this draft and of
a reference draft (a draft model already distilled from the same target) from the target; only the ``filter_keep``
fraction with the largest gap (draft - reference: what the reference shows is learnable and this draft has not yet
learned) is trained, the tokens neither can fit are dropped.
"""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel
from transformers.utils import logging as hf_logging

from headstart.heads.draft_model.selective import keep_learnable
from headstart.models.head import (DraftConfig, FeatureNeeds, Features, check_layout, layer_activation_bytes,
                                  loss_chunk_bytes, shift_left)
from headstart.models.target import text_config
from headstart.models.vocab_loss import VocabProjection, multi_step_loss
from headstart.models.weights_file import write_weights

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json")
"""What an export copies from the target's directory: the draft model is loaded with the target's tokenizer and
generation config (its end-of-turn tokens), as a server loads any model directory."""


@dataclass(frozen=True)
class DraftModelOptions:
    """A draft-model recipe's own ``draft:`` fields."""

    num_layers: int = 2
    """Decoder layers of the draft model (``draft.config`` gives a whole config instead)."""
    init: str = "target"
    """``target``: the target's embeddings, first ``num_layers`` layers, final norm and lm_head; ``fresh``: random."""
    labels: str = "target"
    """``target``: distil the target's distribution (``draft.loss`` picks the divergence); ``data``: cross-entropy to
    the data's next token (the classic draft model's training)."""
    filter_reference: str | None = None
    """AdaSPEC's selective distillation: a reference draft model's directory (a draft model of this target, e.g. one
    distilled with ``filter_reference`` unset); None trains every token."""
    filter_keep: float = 0.4
    """With ``filter_reference``: the fraction of each micro-batch's trained tokens kept (AdaSPEC's k)."""

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"draft.num_layers must be >= 1, got {self.num_layers}")
        if self.init not in ("target", "fresh"):
            raise ValueError(f"draft.init must be 'target' or 'fresh', got {self.init!r}")
        if self.labels not in ("target", "data"):
            raise ValueError(f"draft.labels must be 'target' (distillation) or 'data', got {self.labels!r}")
        if not 0.0 < self.filter_keep <= 1.0:
            raise ValueError(f"draft.filter_keep must be in (0, 1], got {self.filter_keep}")


def check_vocab(config, target_config, where: str) -> None:
    """Refuse, by name, a draft model whose vocabulary is not the target's (q must cover the ids p does)."""
    draft_vocab, target_vocab = text_config(config).vocab_size, text_config(target_config).vocab_size
    if draft_vocab != target_vocab:
        raise ValueError(f"{where}: the draft model's vocab_size {draft_vocab} != the target's {target_vocab}; a draft "
                         "model must share its target's vocabulary")


class DraftModel(nn.Module):
    """A small HF causal LM trained as a draft (``model``), with the target's lm_head as ``teacher`` (never saved)."""

    needs = FeatureNeeds(last_hidden_state=True)
    layouts = ("hf",)  # a plain Hugging Face causal LM directory (docs/FORMATS.md, the draft model section)
    compiled = ("model.model.layers",)

    def __init__(self, model: PreTrainedModel, labels: str = "target", chunk_tokens: int = 1024,
                 divergence: str = "kl", filter_keep: float = 0.4) -> None:
        super().__init__()
        self.model, self.labels, self.chunk_tokens, self.divergence = model, labels, chunk_tokens, divergence
        self.filter_keep = filter_keep
        self.teacher: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.target_dir: str | None = None  # where the export's tokenizer files come from
        self._reference: list[PreTrainedModel] = []  # AdaSPEC's reference (a list: not a submodule, never saved)

    @property
    def config(self):
        return self.model.config

    def set_teacher(self, vocab_head: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The target's lm_head as a function [..., H] -> logits [..., V] (``Target.vocab_head()``)."""
        self.teacher = vocab_head

    def set_reference(self, model: PreTrainedModel) -> None:
        """AdaSPEC's reference draft model (frozen)."""
        self._reference = [model.eval().requires_grad_(False)]

    def target_vocab_ids(self) -> torch.Tensor:
        return torch.arange(self.config.vocab_size, device=self.model.lm_head.weight.device)

    def activation_bytes(self, tokens: int, sequences: int, element_bytes: int) -> dict[str, int]:
        """headstart plan: the draft model's layers, and its (full-vocab) loss over chunks."""
        c = text_config(self.config)
        return {f"draft model activations ({c.num_hidden_layers} layers)":
                c.num_hidden_layers * layer_activation_bytes(tokens, c.hidden_size, c.intermediate_size, element_bytes),
                "loss chunks": loss_chunk_bytes(self.chunk_tokens, c.vocab_size, tokens)}

    # -- training -------------------------------------------------------------------------------
    def forward(self, features: Features) -> tuple[torch.Tensor, dict[str, float]]:
        # Training goes through forward so FSDP2 / ZeRO-3 hooks gather the parameters.
        return self.loss(features)

    def states(self, model: PreTrainedModel, f: Features) -> torch.Tensor:
        """``model``'s final hidden states [B, T, H] over the batch; a packed batch's documents attend to themselves
        (transformers finds them where ``position_ids`` restart, as the target's forward does)."""
        return model.model(input_ids=f.input_ids, position_ids=f.position_ids, use_cache=False).last_hidden_state

    def loss(self, f: Features) -> tuple[torch.Tensor, dict[str, float]]:
        """The divergence of the draft's next-token distribution from the target's, summed over trained tokens."""
        if f.last_hidden_state is None:
            raise ValueError("the draft model is distilled from the target's final hidden state; the features carry none")
        if self.teacher is None:
            raise ValueError("draft-model training needs the target's lm_head (set_teacher)")
        hidden = self.states(self.model, f)
        # multi_step_loss's step 0 trains position t on token t+2 against the target at t+1: the draft's state at t+1
        # predicts that token, so its states go in one position early (a document's first token predicts nothing).
        draft = shift_left(hidden, 1, 0.0)
        project = VocabProjection(lambda z: z, self.model.lm_head.weight)
        if self._reference and self.training and torch.is_grad_enabled():
            f = self.selective(f, draft.detach(), project)
        return multi_step_loss([(project, draft)], f, self.teacher, self.labels == "target", 1.0, self.chunk_tokens,
                               divergence=self.divergence)

    def selective(self, f: Features, draft: torch.Tensor, project: VocabProjection) -> Features:
        """``f`` with AdaSPEC's filter applied to its loss mask: only the most learnable tokens stay trained."""
        reference = self._reference[0].to(draft.device)
        with torch.no_grad():
            ref = self.states(reference, f)
            ref = shift_left(ref, 1, 0.0)
            ref_project = VocabProjection(lambda z: z, reference.lm_head.weight)
            mask = keep_learnable(f, draft, project, ref, ref_project, self.teacher, self.divergence, self.filter_keep,
                                  self.chunk_tokens)
        return Features(**{**f.__dict__, "loss_mask": mask})

    # -- checkpoint -----------------------------------------------------------------------------
    def export_state_dict(self, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The causal LM's tensors under its own (transformers') names; a tied lm_head is not saved twice."""
        state = self.state_dict() if state is None else state
        out = {k.removeprefix("model."): v.detach().to("cpu").contiguous() for k, v in state.items()
               if k.startswith("model.")}
        if getattr(text_config(self.config), "tie_word_embeddings", False):
            out.pop("lm_head.weight", None)
        return out

    def save_pretrained(self, directory: str | Path, dtype: torch.dtype = torch.bfloat16,
                        state_dict: dict[str, torch.Tensor] | None = None, layout: str | None = None,
                        verifier: dict | None = None) -> None:
        """A plain HF causal LM directory: config.json, model.safetensors, generation config and the target's
        tokenizer files (from ``verifier``'s target directory, else the one it was built for)."""
        check_layout(self, layout)
        config = self.config.to_dict()
        config["dtype"] = str(dtype).removeprefix("torch.")
        config.pop("torch_dtype", None)
        write_weights(directory, state_dict if state_dict is not None else self.export_state_dict(), dtype, config)
        directory = Path(directory)
        source = Path((verifier or {}).get("name_or_path") or self.target_dir or "")
        for name in TOKENIZER_FILES:
            if source.name and (source / name).is_file():
                shutil.copyfile(source / name, directory / name)
        if not (directory / "generation_config.json").is_file():
            self.model.generation_config.save_pretrained(directory)

    @classmethod
    def load(cls, directory: str | Path, target) -> "DraftModel":
        """A finished draft model for ``target`` (a Target or TargetMatrices), refused by name if its vocab differs."""
        config_path = Path(directory) / "config.json"
        if not config_path.is_file() or not (Path(directory) / "model.safetensors").is_file():
            raise FileNotFoundError(f"{directory}: expected config.json and model.safetensors of a causal LM")
        config = AutoConfig.from_pretrained(str(directory))
        check_vocab(config, target.config, str(config_path))
        model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
        head = cls(model)
        head.target_dir = getattr(target, "path", None)
        return head


@contextmanager
def quiet_transformers():
    """transformers' logging at errors only, for one call."""
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def draft_config(target_path: str, num_layers: int, config_file: str | None):
    """The draft model's HF config: ``config_file``'s, or the target's cut to ``num_layers`` layers."""
    config = AutoConfig.from_pretrained(config_file or target_path)
    if config_file is None:
        config.num_hidden_layers = num_layers
        if getattr(config, "layer_types", None):  # per-layer attention kinds (sliding / full): the first ones
            config.layer_types = config.layer_types[:num_layers]
    config.use_cache = True
    return config


def build_draft_model(draft: DraftConfig, target, token_counts: torch.Tensor) -> DraftModel:
    """A draft model for ``target`` (a Target or TargetMatrices: its ``path`` is read for the weights and config)."""
    options = draft.options or DraftModelOptions()
    if draft.loss != "kl" and options.labels != "target":
        raise ValueError(f"draft.loss={draft.loss!r} compares the draft with the target's distribution; it needs "
                         "draft.labels=target, not data")
    if options.init == "target" and draft.config:
        raise ValueError("draft.config gives a fresh draft model's shape; draft.init=target takes the target's own "
                         "(set draft.init=fresh, or drop draft.config)")
    config = draft_config(target.path, options.num_layers, draft.config)
    check_vocab(config, target.config, draft.config or "the draft model's config")
    if options.init == "target":  # transformers loads the layers the cut config has and skips the rest (quietly:
        with quiet_transformers():  # its load report would list every skipped layer's tensors)
            model = AutoModelForCausalLM.from_pretrained(target.path, config=config, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.generation_config = GenerationConfig.from_model_config(config)
    head = DraftModel(model.train(), labels=options.labels, chunk_tokens=draft.loss_chunk_tokens,
                      divergence=draft.loss, filter_keep=options.filter_keep)
    head.target_dir = target.path
    head.set_teacher(target.vocab_head())
    if options.filter_reference:
        reference = DraftModel.load(options.filter_reference, target).model
        head.set_reference(reference)
    return head
