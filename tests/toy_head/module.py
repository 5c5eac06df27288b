"""The toy head: one residual cell applied again and again to the target's final hidden state, the target's lm_head
(a trainable copy) reading each result. Step s at position t predicts token t+2+s:

    z_0 = h_t,   z_{s+1} = z_s + SiLU(W z_s + b),   logits_s = lm_head(z_{s+1})

Medusa with one shared block instead of K, so the smallest head that still drafts several tokens. It exists to show
what a head is to headstart: this folder and one catalog line (tests/conftest.py), and the conformance suite
(tests/test_catalog.py) passes for it as for every shipped head."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from headstart.models.head import DraftConfig, FeatureNeeds, Features, check_layout, loss_chunk_bytes
from headstart.models.target import text_config
from headstart.models.vocab_loss import VocabProjection, multi_step_loss
from headstart.models.weights_file import read_weights, write_weights

ARCHITECTURE = "HeadstartToyHead"


@dataclass(frozen=True)
class ToyOptions:
    """The toy recipe's own ``draft:`` fields."""

    num_steps: int = 3
    """Drafts trained per position (the cell applied 1..num_steps times)."""
    step_weight: float = 0.8
    """Loss weight of step s is step_weight**s."""


class ToyHead(nn.Module):
    needs = FeatureNeeds(last_hidden_state=True)
    layouts = ("headstart",)
    compiled = ("cell",)

    def __init__(self, hidden_size: int, vocab_size: int, num_steps: int = 3, step_weight: float = 0.8,
                 chunk_tokens: int = 1024, divergence: str = "kl") -> None:
        super().__init__()
        if num_steps < 1:
            raise ValueError(f"the toy head needs num_steps >= 1, got {num_steps}")
        self.hidden_size, self.vocab_size, self.num_steps = hidden_size, vocab_size, num_steps
        self.step_weight, self.chunk_tokens, self.divergence = step_weight, chunk_tokens, divergence
        self.cell = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.cell.weight)  # the identity at first: step s starts as the target's next-token guess
        nn.init.zeros_(self.cell.bias)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        self.teacher = None  # the target's lm_head as a function, for soft labels (set at build; never saved)

    def advance(self, z: torch.Tensor) -> torch.Tensor:
        """One step of the recurrence: z + SiLU(W z + b)."""
        return z + F.silu(self.cell(z))

    def target_vocab_ids(self) -> torch.Tensor:
        return torch.arange(self.vocab_size, device=self.lm_head.weight.device)

    def activation_bytes(self, tokens: int, sequences: int, element_bytes: int) -> dict[str, int]:
        return {"cell": self.num_steps * tokens * self.hidden_size * 3 * element_bytes,
                "loss chunks": loss_chunk_bytes(self.chunk_tokens, self.vocab_size, tokens)}

    def forward(self, features: Features) -> tuple[torch.Tensor, dict[str, float]]:
        return self.loss(features)

    def loss(self, f: Features) -> tuple[torch.Tensor, dict[str, float]]:
        def repeated(s: int):
            def pre(z: torch.Tensor) -> torch.Tensor:
                for _ in range(s + 1):
                    z = self.advance(z)
                return z
            return pre

        steps = ((VocabProjection(repeated(s), self.lm_head.weight), f.last_hidden_state) for s in range(self.num_steps))
        return multi_step_loss(steps, f, self.teacher, True, self.step_weight, self.chunk_tokens, divergence=self.divergence)

    def export_state_dict(self, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().contiguous() for k, v in (self.state_dict() if state is None else state).items()}

    def save_pretrained(self, directory: str | Path, dtype: torch.dtype = torch.bfloat16,
                        state_dict: dict[str, torch.Tensor] | None = None, layout: str | None = None,
                        verifier: dict | None = None) -> None:
        check_layout(self, layout)
        config = {"architectures": [ARCHITECTURE], "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
                  "num_steps": self.num_steps, "torch_dtype": str(dtype).removeprefix("torch.")}
        write_weights(directory, state_dict if state_dict is not None else self.export_state_dict(), dtype, config)

    @classmethod
    def load(cls, directory: str | Path, target) -> "ToyHead":
        path = Path(directory) / "config.json"
        config = json.loads(path.read_text())
        tc = text_config(target.config)
        wrong = [f"{k} {config.get(k)} != the target's {getattr(tc, k)}" for k in ("hidden_size", "vocab_size")
                 if config.get(k) != getattr(tc, k)]
        if wrong:
            raise ValueError(f"{path}: the toy head does not fit the target: " + "; ".join(wrong))
        head = cls(config["hidden_size"], config["vocab_size"], config["num_steps"])
        head.load_state_dict(read_weights(directory, dict(head.state_dict()), "toy"))
        return head


def build_toy(draft: DraftConfig, target, token_counts: torch.Tensor) -> ToyHead:
    options = draft.options or ToyOptions()
    tc = text_config(target.config)
    head = ToyHead(tc.hidden_size, tc.vocab_size, options.num_steps, options.step_weight, draft.loss_chunk_tokens,
                   draft.loss)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head_weight.to(head.lm_head.weight.dtype))
    head.teacher = target.vocab_head()
    return head


def detect_toy(directory: Path, config: dict) -> str | None:
    return "headstart" if config.get("architectures") == [ARCHITECTURE] else None
