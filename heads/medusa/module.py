"""Medusa-1 heads on a frozen target, in exactly the layout vLLM loads (docs/FORMATS.md section C).

    h_t               = the target's final hidden state at t (after its final norm: what its lm_head reads)
    head i (1..K):    x = blocks[i-1](h_t),  each of ``num_layers`` ResBlocks  x <- x + SiLU(W x + b)
                      logits_i = lm_heads[i-1](x)          # predicts token t+i+1 (the target's lm_head: t+1)

W and b start at zero, so every head starts as the identity, and every lm_head starts as a copy of
the target's: head i begins by guessing token t+1 for t+i+1 and learns the shift.

A truncated vocab (vLLM's ``truncated_vocab_size`` + ``token_map``) keeps each lm_head to the N most
frequent trained tokens: four full-vocab heads of a 49k-vocab target are 229 MB, four of 4,096 rows 21 MB.
``token_map`` [N] lists their target ids, ascending; vLLM scatters the N logits into the full vocab.

Training (Medusa-1, frozen target): per-head cross-entropy against the target's own distribution
at t+i (self-distillation; the target's lm_head over its final hidden state at t+i, which predicts
token t+i+1) or against the data's token t+i+1 (``labels="data"``), on assistant tokens, head i
weighted ``step_weight**(i-1)``. The vocab is the target's full vocab (V = 128k-150k for real
targets), so logits are computed a chunk of positions at a time and recomputed in backward: no
[B, T, V] float32 tensor exists, for any head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from headstart.models.blocks import ResidualBlock
from headstart.models.head import DraftConfig, FeatureNeeds, Features, check_layout, loss_chunk_bytes
from headstart.models.target import text_config
from headstart.models.vocab_loss import VocabProjection, multi_step_loss
from headstart.models.weights_file import read_weights, write_weights
from headstart.models.draft_vocab import build_draft_vocab


@dataclass(frozen=True)
class MedusaOptions:
    """A Medusa recipe's own ``draft:`` fields."""

    num_heads: int = 4
    """Heads K: head i predicts the token i+1 positions after the next one."""
    num_layers: int = 1
    """ResBlocks per head."""
    truncated_vocab_size: int | None = None
    """Each head predicts only the N most frequent trained tokens (vLLM's token_map layout; smaller exports and
    cheaper heads, a token outside them is never drafted); None = the target's full vocab."""
    labels: str = "target"
    """What the heads learn: target (the target's own distribution, self-distillation) | data (the data's tokens)."""
    step_weight: float = 0.8
    """Loss weight of head k+1 is step_weight**k."""


@dataclass(frozen=True)
class MedusaConfig:
    """The heads' shape; serialised as vLLM's Medusa config.json."""

    head_name = "Medusa"  # what the refusals call these heads (a subclass's are others)

    hidden_size: int  # the target's hidden size H
    vocab_size: int  # the target vocab V
    num_heads: int = 4
    num_layers: int = 1  # ResBlocks per head
    truncated_vocab_size: int | None = None  # rows of each lm_head (a token_map vocab); None = vocab_size

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_layers < 1:
            raise ValueError(f"{self.head_name} needs num_heads >= 1 and num_layers >= 1, got {self.num_heads} / "
                             f"{self.num_layers}")
        if self.truncated_vocab_size is not None and not 0 < self.truncated_vocab_size <= self.vocab_size:
            raise ValueError(f"{self.head_name} truncated_vocab_size must be in 1..{self.vocab_size} (the target vocab), "
                             f"got {self.truncated_vocab_size}")

    @property
    def draft_vocab_size(self) -> int:
        """Rows of each lm_head: the truncated vocab, or the target's."""
        return self.truncated_vocab_size or self.vocab_size

    @property
    def truncated(self) -> bool:
        return self.draft_vocab_size < self.vocab_size

    @classmethod
    def from_target(cls, target_config, num_heads: int = 4, num_layers: int = 1,
                    truncated_vocab_size: int | None = None) -> "MedusaConfig":
        tc = text_config(target_config)
        return cls(hidden_size=tc.hidden_size, vocab_size=tc.vocab_size, num_heads=num_heads, num_layers=num_layers,
                   truncated_vocab_size=truncated_vocab_size if truncated_vocab_size != tc.vocab_size else None)

    def to_hf_dict(self, dtype: torch.dtype = torch.bfloat16) -> dict:
        """vLLM's MedusaConfig. vLLM renames every top-level key containing "num" and "heads" (or
        "layers"), so no other such key is written."""
        return {
            "architectures": ["MedusaModel"],
            "model_type": "medusa",
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "num_heads": self.num_heads,
            "num_hidden_layers": self.num_layers,
            "truncated_vocab_size": self.draft_vocab_size,  # < vocab_size: model.safetensors holds token_map
            "medusa_fc_bias": True,
            "original_lm_head": False,  # one lm_head per head
            "torch_dtype": str(dtype).removeprefix("torch."),
        }

    @classmethod
    def from_hf_dict(cls, d: dict, where: str = "config.json") -> "MedusaConfig":
        if d.get("architectures") != ["MedusaModel"] or d.get("model_type") != "medusa":
            raise ValueError(f"{where}: not a Medusa config (architectures={d.get('architectures')}, "
                             f"model_type={d.get('model_type')!r})")
        missing = [k for k in ("hidden_size", "vocab_size", "num_heads", "num_hidden_layers") if d.get(k) is None]
        if missing:
            raise ValueError(f"{where}: Medusa config lacks {missing}")
        if not d.get("medusa_fc_bias", False) or d.get("original_lm_head", False):
            raise ValueError(f"{where}: headstart's Medusa heads have ResBlock biases and one lm_head per head "
                             "(medusa_fc_bias true, original_lm_head false)")
        truncated = d.get("truncated_vocab_size") or d["vocab_size"]
        return cls(hidden_size=d["hidden_size"], vocab_size=d["vocab_size"], num_heads=d["num_heads"],
                   num_layers=d["num_hidden_layers"], truncated_vocab_size=truncated if truncated != d["vocab_size"] else None)

    def check_target(self, target_config, where: str | None = None) -> None:
        """Refuse, by name, heads made for a target of another hidden size or vocab."""
        tc = text_config(target_config)
        problems = []
        if self.hidden_size != tc.hidden_size:
            problems.append(f"hidden_size {self.hidden_size} != target hidden_size {tc.hidden_size}")
        if self.vocab_size != tc.vocab_size:
            problems.append(f"vocab_size {self.vocab_size} != target vocab_size {tc.vocab_size}")
        if problems:
            raise ValueError(f"{where or f'the {self.head_name} config'}: the {self.head_name} heads do not fit the "
                             "target:\n  " + "\n  ".join(problems))


class MedusaHeads(nn.Module):
    """K Medusa heads. ``teacher`` (the target's lm_head as a function [..., H] -> [..., V]) is set for
    training with the target's distribution; it is not a parameter and is never saved."""

    needs = FeatureNeeds(last_hidden_state=True)
    layouts = ("vllm",)  # docs/FORMATS.md section C
    compiled = ("blocks",)
    """What ``train.compile`` compiles (models/train_compile.py): each head's residual block."""

    def __init__(self, config: MedusaConfig, step_weight: float = 0.8, labels: str = "target",
                 chunk_tokens: int = 1024, divergence: str = "kl") -> None:
        super().__init__()
        self.divergence = divergence  # DraftConfig.loss (models/vocab_loss.py divergence_sum)
        if labels not in ("target", "data"):
            raise ValueError(f"Medusa labels must be 'target' (self-distillation) or 'data', got {labels!r}")
        self.config, self.step_weight, self.labels, self.chunk_tokens = config, step_weight, labels, chunk_tokens
        H, V = config.hidden_size, config.draft_vocab_size
        self.blocks = nn.ModuleList(ResidualBlock(H, config.num_layers) for _ in range(config.num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(H, V, bias=False) for _ in range(config.num_heads))
        # vLLM's ``token_map`` [V'] int64 (saved with the weights) for a truncated vocab; set by set_token_map
        # or a checkpoint. None: the full vocab.
        self.register_buffer("token_map", torch.arange(V, dtype=torch.int64) if config.truncated else None)
        self.teacher: Callable[[torch.Tensor], torch.Tensor] | None = None

    def activation_bytes(self, tokens: int, sequences: int, element_bytes: int) -> dict[str, int]:
        """headstart plan: each head's ResBlocks keep their linear output, activation and residual per token; the
        heads' losses run one after another over chunks of their (possibly truncated) vocab."""
        c = self.config
        blocks = c.num_heads * c.num_layers * tokens * c.hidden_size * 3 * element_bytes
        return {f"head activations ({c.num_heads} heads)": blocks,
                "loss chunks": loss_chunk_bytes(self.chunk_tokens, c.draft_vocab_size, tokens)}

    def set_token_map(self, token_map: torch.Tensor) -> None:
        """The target ids [V'] the heads predict, ascending (e.g. the most frequent trained tokens)."""
        if not self.config.truncated:
            raise ValueError("these Medusa heads predict the full vocab; a token_map needs truncated_vocab_size")
        ids = token_map.to(torch.int64)
        if ids.shape != self.token_map.shape or not bool((ids[1:] > ids[:-1]).all()) or int(ids.max()) >= self.config.vocab_size:
            raise ValueError(f"token_map must be {self.config.draft_vocab_size} strictly increasing ids below "
                             f"{self.config.vocab_size}, got shape {tuple(ids.shape)}")
        self.token_map.copy_(ids)

    def set_teacher(self, vocab_head: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The target's lm_head as a function [..., H] -> logits [..., V] (``Target.vocab_head()``)."""
        self.teacher = vocab_head

    def load_target_lm_head(self, weight: torch.Tensor) -> None:
        """Every head's vocab projection starts as the target's lm_head [V, H] (its token_map rows)."""
        if tuple(weight.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(f"target lm_head is {tuple(weight.shape)}, the heads expect "
                             f"{(self.config.vocab_size, self.config.hidden_size)}")
        rows = weight if self.token_map is None else weight[self.token_map.to(weight.device)]
        with torch.no_grad():
            for lm_head in self.lm_heads:
                lm_head.weight.copy_(rows.to(lm_head.weight.dtype))

    def target_vocab_ids(self) -> torch.Tensor:
        """The target id of each lm_head row [V']."""
        if self.token_map is not None:
            return self.token_map
        return torch.arange(self.config.vocab_size, device=self.lm_heads[0].weight.device)

    # -- inference ------------------------------------------------------------------------------
    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> every head's logits [K, ..., V'] over ``target_vocab_ids`` (row i-1 predicts
        token t+i+1)."""
        return torch.stack([self.logits_of(k, hidden) for k in range(self.config.num_heads)])

    def logits_of(self, k: int, hidden: torch.Tensor) -> torch.Tensor:
        """Head k+1's logits [..., V'] for hidden [..., H]."""
        return self.lm_heads[k](self.blocks[k](hidden.to(self.lm_heads[k].weight.dtype)))

    # -- training -------------------------------------------------------------------------------
    def forward(self, features: Features) -> tuple[torch.Tensor, dict[str, float]]:
        # Training goes through forward so FSDP2 / ZeRO-3 hooks gather the parameters.
        return self.loss(features)

    def loss(self, f: Features) -> tuple[torch.Tensor, dict[str, float]]:
        """Sum over heads of step_weight**(i-1) x (mean cross-entropy of head i over its trained positions)."""
        if f.last_hidden_state is None:
            raise ValueError("Medusa heads read the target's final hidden state; the features carry none")
        if self.teacher is None:
            raise ValueError("Medusa training needs the target's lm_head (set_teacher) for soft labels and metrics")
        steps = ((VocabProjection(lambda z, k=k: self.blocks[k](z.to(self.lm_heads[k].weight.dtype)), self.lm_heads[k].weight),
                  f.last_hidden_state) for k in range(self.config.num_heads))
        return multi_step_loss(steps, f, self.teacher, self.labels == "target", self.step_weight, self.chunk_tokens,
                               vocab_ids=self.token_map, divergence=self.divergence)

    # -- checkpoint -----------------------------------------------------------------------------
    def export_state_dict(self, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Tensors under vLLM's names: blocks.{i}.layers.{j}.{weight,bias}, lm_heads.{i}.weight (and token_map)."""
        return {name: t.detach().to("cpu").contiguous() for name, t in (self.state_dict() if state is None else state).items()}

    def save_pretrained(self, directory: str | Path, dtype: torch.dtype = torch.bfloat16,
                        state_dict: dict[str, torch.Tensor] | None = None, layout: str | None = None,
                        verifier: dict | None = None) -> None:
        check_layout(self, layout)  # vLLM's layout only; its config does not name the target
        tensors = state_dict if state_dict is not None else self.export_state_dict()
        write_weights(directory, tensors, dtype, self.config.to_hf_dict(dtype))  # token_map stays int64

    @classmethod
    def from_pretrained(cls, directory: str | Path, **kwargs) -> "MedusaHeads":
        directory = Path(directory)
        if not (directory / "config.json").is_file() or not (directory / "model.safetensors").is_file():
            raise FileNotFoundError(f"{directory}: expected config.json and model.safetensors of Medusa heads")
        config = MedusaConfig.from_hf_dict(json.loads((directory / "config.json").read_text()), str(directory / "config.json"))
        model = cls(config, **kwargs)
        model.load_state_dict(read_weights(directory, dict(model.state_dict()), "Medusa"))
        return model

    @classmethod
    def load(cls, directory: str | Path, target) -> "MedusaHeads":
        """Finished heads for ``target`` (a Target or TargetMatrices), refused by name if they do not fit."""
        config_path = Path(directory) / "config.json"
        if config_path.is_file():  # check the shape before reading tensors of the wrong size
            MedusaConfig.from_hf_dict(json.loads(config_path.read_text()), str(config_path)).check_target(
                target.config, str(config_path))
        return cls.from_pretrained(directory)


def build_medusa(draft: DraftConfig, target, token_counts: torch.Tensor) -> MedusaHeads:
    """Fresh Medusa heads for ``target`` (a Target or TargetMatrices), their lm_heads starting as the target's."""
    options = draft.options or MedusaOptions()
    if draft.config:
        config = MedusaConfig.from_hf_dict(json.loads(Path(draft.config).read_text()), draft.config)
    else:
        config = MedusaConfig.from_target(target.config, options.num_heads, options.num_layers,
                                          options.truncated_vocab_size)
    config.check_target(target.config)
    if draft.loss != "kl" and options.labels != "target":
        raise ValueError(f"draft.loss={draft.loss!r} compares the heads with the target's distribution; it needs "
                         "draft.labels=target, not data")
    head = MedusaHeads(config, step_weight=options.step_weight, labels=options.labels,
                       chunk_tokens=draft.loss_chunk_tokens, divergence=draft.loss)
    if config.truncated:  # the most frequent trained tokens, ascending (EAGLE-3's draft vocab rule)
        _, t2d = build_draft_vocab(token_counts, config.draft_vocab_size)
        head.set_token_map(t2d.nonzero().squeeze(1))
    head.load_target_lm_head(target.lm_head_weight)
    head.set_teacher(target.vocab_head())
    return head


def detect_medusa(directory: Path, config: dict) -> str | None:
    """The layout of an exported head whose config.json is ``config``, if it is Medusa's."""
    arch = (config.get("architectures") or [None])[0]
    return "vllm" if arch == "MedusaModel" or config.get("model_type") == "medusa" else None

