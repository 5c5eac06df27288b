"""Early-exit self-speculation (LayerSkip's drafting on a frozen target; a Kangaroo-style adapter): the target drafts
with its own first E layers.

    h_t     = the target's hidden state after its first E decoder layers at t (HF ``hidden_states[E]``)
    logits  = lm_head(norm(adapter(h_t)))    # the target's own final norm and lm_head, frozen
    adapter = ``num_layers`` residual blocks z <- z + SiLU(W z + b), W and b starting at zero

A fresh adapter is the identity: the draft is then the target's lm_head read at layer E (early exit with no
training); training teaches the adapter what the skipped layers would have added, against the target's full
distribution (features: the hidden state at layer E, one of ``target.aux_layer_ids``; labels: the final hidden
state; ``draft.exit_layer`` picks E among several captured layers). Decoding drafts with layers 0..E-1 on the target's own KV cache (decode/target_runner.py
``forward_layers``): the committed context's first-layer K/V that verification wrote are read, not kept twice.
The export is the adapter alone in headstart's own layout (docs/FORMATS.md K): no server runs early exit.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM

from headstart.models.blocks import ResidualBlock
from headstart.models.head import DraftConfig, FeatureNeeds, Features, check_layout, loss_chunk_bytes, shift_left
from headstart.models.target import text_config
from headstart.models.target_matrices import weight_files
from headstart.models.vocab_loss import multi_step_loss
from headstart.models.weights_file import read_weights, write_weights

ARCHITECTURE = "HeadstartEarlyExit"


@dataclass(frozen=True)
class EarlyExitOptions:
    """An early-exit recipe's own ``draft:`` fields."""

    exit_layer: int | None = None
    """E: the draft reads the hidden state after the target's first E layers (HF ``hidden_states[E]``). It must be one
    of ``target.aux_layer_ids`` (the layers the features carry: one feature store with several serves a sweep of E);
    None: the only one."""
    num_layers: int = 1
    """Residual blocks of the adapter."""

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"draft.num_layers must be >= 1, got {self.num_layers}")


@dataclass(frozen=True)
class EarlyExitConfig:
    hidden_size: int
    vocab_size: int
    exit_layer: int
    """E: the draft reads the hidden state after the target's first E decoder layers."""
    target_num_layers: int
    num_layers: int = 1

    def __post_init__(self) -> None:
        if not 0 < self.exit_layer < self.target_num_layers:
            raise ValueError(f"the exit layer must be in 1..{self.target_num_layers - 1} (the target has "
                             f"{self.target_num_layers} layers), got {self.exit_layer}")

    @classmethod
    def from_target(cls, target, options: EarlyExitOptions) -> "EarlyExitConfig":
        ids = tuple(target.aux_layer_ids)
        if options.exit_layer is None and len(ids) != 1:
            raise ValueError(f"early exit reads one layer's hidden state: set draft.exit_layer to one of "
                             f"target.aux_layer_ids {list(ids)}, or target.aux_layer_ids to [E]")
        exit_layer = ids[0] if options.exit_layer is None else options.exit_layer
        if exit_layer not in ids:
            raise ValueError(f"draft.exit_layer {exit_layer} is not among target.aux_layer_ids {list(ids)}: the features "
                             "carry only those layers' hidden states")
        tc = text_config(target.config)
        return cls(hidden_size=tc.hidden_size, vocab_size=tc.vocab_size, exit_layer=exit_layer,
                   target_num_layers=tc.num_hidden_layers, num_layers=options.num_layers)

    def to_dict(self) -> dict:
        return {"architectures": [ARCHITECTURE], "model_type": "headstart_early_exit", **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "EarlyExitConfig":
        if (d.get("architectures") or [None])[0] != ARCHITECTURE:
            raise ValueError(f"{where}: not an early-exit adapter's config (architectures={d.get('architectures')})")
        fields = ("hidden_size", "vocab_size", "exit_layer", "target_num_layers", "num_layers")
        missing = [k for k in fields if k not in d]
        if missing:
            raise ValueError(f"{where}: lacks {missing}")
        return cls(**{k: d[k] for k in fields})

    def check_target(self, target_config, where: str) -> None:
        tc = text_config(target_config)
        got = {"hidden_size": tc.hidden_size, "vocab_size": tc.vocab_size, "target_num_layers": tc.num_hidden_layers}
        wrong = [f"{k} {getattr(self, k)} != the target's {v}" for k, v in got.items() if getattr(self, k) != v]
        if wrong:
            raise ValueError(f"{where}: the adapter does not fit the target: " + "; ".join(wrong))


def final_norm(target) -> nn.Module:
    """A frozen copy of the target's final norm, of its own class (so its rule -- Gemma's 1 + w too -- is the
    target's): the live model's, or one built on the meta device and filled from the checkpoint (offline)."""
    model = getattr(target, "model", None)
    if model is not None:
        norm = copy.deepcopy(getattr(model, model.base_model_prefix).norm)
    else:
        with torch.device("meta"):
            shell = AutoModelForCausalLM.from_config(target.config)
        norm = getattr(shell, shell.base_model_prefix).norm.to_empty(device="cpu")
        files = weight_files(Path(target.path))
        names = sorted((n for n in files if n.endswith("norm.weight") and "layers." not in n), key=len)
        if not names:
            raise ValueError(f"{target.path}: no final norm tensor ('*norm.weight' outside the layers) in its safetensors")
        with safe_open(str(files[names[0]]), framework="pt") as f:
            norm.weight.data.copy_(f.get_tensor(names[0]))
    return norm.float().requires_grad_(False)


class EarlyExitAdapter(nn.Module):
    """The adapter, with the target's final norm and vocab head (``set_target``: frozen, never saved)."""

    needs = FeatureNeeds(aux_hidden_states=True, last_hidden_state=True)
    layouts = ("headstart",)
    compiled = ("blocks",)

    def __init__(self, config: EarlyExitConfig, chunk_tokens: int = 1024, divergence: str = "kl") -> None:
        super().__init__()
        self.config, self.chunk_tokens, self.divergence = config, chunk_tokens, divergence
        self.blocks = ResidualBlock(config.hidden_size, config.num_layers)
        self._target: list = []  # [norm, vocab head]: not submodules, never saved or sharded
        self.aux_index = 0  # where the exit layer's state sits among the features' aux layers (training)

    def set_target(self, norm: nn.Module, vocab_head) -> None:
        self._target = [norm, vocab_head]

    def target_vocab_ids(self) -> torch.Tensor:
        return torch.arange(self.config.vocab_size)

    def activation_bytes(self, tokens: int, sequences: int, element_bytes: int) -> dict[str, int]:
        """headstart plan: each block keeps its linear output, activation and residual; the loss runs over chunks."""
        c = self.config
        return {f"adapter activations ({c.num_layers} blocks)": c.num_layers * tokens * c.hidden_size * 3 * element_bytes,
                "loss chunks": loss_chunk_bytes(self.chunk_tokens, c.vocab_size, tokens)}

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden state after layer E [..., H] -> the draft's logits [..., V]."""
        norm, vocab_head = self._target
        if norm.weight.device != hidden.device:
            self._target[0] = norm = norm.to(hidden.device)
        x = self.blocks(hidden.to(self.blocks.layers[0].weight.dtype))
        return vocab_head(norm(x.to(norm.weight.dtype)).to(hidden.dtype))

    def forward(self, features: Features) -> tuple[torch.Tensor, dict[str, float]]:
        return self.loss(features)

    def loss(self, f: Features) -> tuple[torch.Tensor, dict[str, float]]:
        """The divergence of the draft's next-token distribution at layer E from the target's, per trained token."""
        if f.aux_hidden_states is None or f.last_hidden_state is None:
            raise ValueError("early exit reads the target's hidden state at the exit layer and its final hidden state")
        if not self._target:
            raise ValueError("early-exit training needs the target's final norm and lm_head (set_target)")
        H = self.config.hidden_size
        h = f.aux_hidden_states[..., self.aux_index * H:(self.aux_index + 1) * H]
        # multi_step_loss's step 0 trains position t on token t+2 against the target at t+1: the state at t+1 predicts
        # that token, so the states go in one position early.
        draft = shift_left(h, 1, 0.0)
        return multi_step_loss([(self.draft_logits, draft)], f, self._target[1], True, 1.0, self.chunk_tokens,
                               divergence=self.divergence)

    def export_state_dict(self, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu").contiguous() for k, v in (self.state_dict() if state is None else state).items()}

    def save_pretrained(self, directory: str | Path, dtype: torch.dtype = torch.bfloat16,
                        state_dict: dict[str, torch.Tensor] | None = None, layout: str | None = None,
                        verifier: dict | None = None) -> None:
        check_layout(self, layout)
        write_weights(directory, state_dict if state_dict is not None else self.export_state_dict(), dtype,
                      self.config.to_dict())

    @classmethod
    def load(cls, directory: str | Path, target) -> "EarlyExitAdapter":
        """A finished adapter for ``target`` (a Target or TargetMatrices), refused by name if it does not fit."""
        path = Path(directory) / "config.json"
        if not path.is_file() or not (Path(directory) / "model.safetensors").is_file():
            raise FileNotFoundError(f"{directory}: expected config.json and model.safetensors of an early-exit adapter")
        config = EarlyExitConfig.from_dict(json.loads(path.read_text()), str(path))
        config.check_target(target.config, str(path))
        head = cls(config)
        head.load_state_dict(read_weights(directory, dict(head.state_dict()), "early-exit"))
        head.set_target(final_norm(target), target.vocab_head())
        return head


def build_early_exit(draft: DraftConfig, target, token_counts: torch.Tensor) -> EarlyExitAdapter:
    """A fresh adapter (the identity: plain early exit) at the target's one aux layer."""
    options = draft.options or EarlyExitOptions()
    config = EarlyExitConfig.from_target(target, options)
    head = EarlyExitAdapter(config, chunk_tokens=draft.loss_chunk_tokens, divergence=draft.loss)
    head.aux_index = tuple(target.aux_layer_ids).index(config.exit_layer)
    head.set_target(final_norm(target), target.vocab_head())
    return head


def detect_early_exit(directory: Path, config: dict) -> str | None:
    return "headstart" if (config.get("architectures") or [None])[0] == ARCHITECTURE else None
