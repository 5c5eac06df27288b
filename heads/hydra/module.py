"""Hydra heads (Ankner et al., 2024, arXiv 2402.05109): Medusa heads that read the tokens already drafted.

    h_t                 = the target's final hidden state at t (after its final norm: what its lm_head reads)
    x_{t+1}             = the token the target itself emits after t (a round's bonus token)
    head s (0..K-1):    z = [h_t, E(x_{t+1}), E(d_{t+2}), ..., E(d_{t+1+s})]         # (s + 2) H wide
                        z = ResBlocks_s(W_s z)           # W_s: (s+2)H -> H; each block z <- z + SiLU(A z + b)
                        logits_s = lm_head_s(z)          # predicts token t+2+s

E is the target's input embedding (frozen). Head s reads the drafts of heads 0..s-1 -- Hydra's sequential
dependence -- so a chain does not collapse after its first draft the way Medusa's independent heads do. Training
feeds the data's own tokens in their place (teacher forcing; on data the target regenerated, those are the target's
tokens) and, as Hydra++'s best variant, learns the target's distribution (``labels="target"``, distillation).

W_s starts as [I, 0, ..., 0] (h_t alone), the blocks as the identity and each lm_head as the target's, so a fresh
head predicts what the target's lm_head does from h_t, as a fresh Medusa head does, and learns the shift and the use
of the drafted tokens. No server loads Hydra heads: they are saved in headstart's own layout (docs/FORMATS.md, the
Hydra section), which headstart's decoder reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from headstart.heads.medusa.module import MedusaConfig
from headstart.models.blocks import ResidualBlock
from headstart.models.draft_vocab import build_draft_vocab
from headstart.models.head import DraftConfig, FeatureNeeds, Features, check_layout, loss_chunk_bytes, shift_left
from headstart.models.target import text_config
from headstart.models.vocab_loss import VocabProjection, multi_step_loss
from headstart.models.weights_file import read_weights, write_weights


@dataclass(frozen=True)
class HydraOptions:
    """A Hydra recipe's own ``draft:`` fields."""

    num_heads: int = 4
    """Heads K: head s predicts the token s+1 positions after the next one, reading the s drafts before it."""
    num_layers: int = 1
    """ResBlocks per head, after its input projection."""
    truncated_vocab_size: int | None = None
    """Each head predicts only the N most frequent trained tokens (ascending ``token_map``); None = the full vocab."""
    labels: str = "target"
    """What the heads learn: target (the target's distribution: Hydra++'s distillation) | data (the data's tokens)."""
    step_weight: float = 0.8
    """Loss weight of head s is step_weight**s."""


@dataclass(frozen=True)
class HydraConfig(MedusaConfig):
    """The heads' shape (Medusa's fields and rules); serialised as headstart's ``HydraModel`` config.json."""

    head_name = "Hydra"

    @classmethod
    def from_target(cls, target_config, options: HydraOptions) -> "HydraConfig":
        tc = text_config(target_config)
        truncated = options.truncated_vocab_size
        return cls(hidden_size=tc.hidden_size, vocab_size=tc.vocab_size, num_heads=options.num_heads,
                   num_layers=options.num_layers, truncated_vocab_size=truncated if truncated != tc.vocab_size else None)

    # Medusa's serialisers by name, overridden: no path writes or reads a Hydra config as ``MedusaModel``.
    def to_hf_dict(self, dtype: torch.dtype = torch.bfloat16) -> dict:
        return {"architectures": ["HydraModel"], "model_type": "hydra", "hidden_size": self.hidden_size,
                "vocab_size": self.vocab_size, "num_heads": self.num_heads, "num_layers": self.num_layers,
                "draft_vocab_size": self.draft_vocab_size, "torch_dtype": str(dtype).removeprefix("torch."),
                "note": "headstart's own layout for Hydra heads; no server loads it (see headstart docs/FORMATS.md)"}

    @classmethod
    def from_hf_dict(cls, d: dict, where: str = "config.json") -> "HydraConfig":
        if d.get("architectures") != ["HydraModel"] or d.get("model_type") != "hydra":
            raise ValueError(f"{where}: not a Hydra config (architectures={d.get('architectures')}, "
                             f"model_type={d.get('model_type')!r})")
        missing = [k for k in ("hidden_size", "vocab_size", "num_heads", "num_layers") if d.get(k) is None]
        if missing:
            raise ValueError(f"{where}: Hydra config lacks {missing}")
        truncated = d.get("draft_vocab_size") or d["vocab_size"]
        return cls(hidden_size=d["hidden_size"], vocab_size=d["vocab_size"], num_heads=d["num_heads"],
                   num_layers=d["num_layers"], truncated_vocab_size=truncated if truncated != d["vocab_size"] else None)


class HydraHead(nn.Module):
    """One head: its input projection over [h_t, embeddings of the tokens before its own], ResBlocks, lm_head."""

    def __init__(self, hidden_size: int, reads: int, num_layers: int, vocab: int) -> None:
        super().__init__()
        self.proj = nn.Linear(reads * hidden_size, hidden_size, bias=False)
        with torch.no_grad():  # h_t alone at the start: the head begins as a Medusa head does
            self.proj.weight.zero_()
            self.proj.weight[:, :hidden_size] = torch.eye(hidden_size)
        self.block = ResidualBlock(hidden_size, num_layers)
        self.lm_head = nn.Linear(hidden_size, vocab, bias=False)

    def features(self, z: torch.Tensor) -> torch.Tensor:
        """[..., reads * H] -> [..., H]: what lm_head reads."""
        return self.block(self.proj(z.to(self.proj.weight.dtype)))


class HydraHeads(nn.Module):
    """K Hydra heads. ``teacher`` (the target's lm_head as a function) is set for training; never saved."""

    needs = FeatureNeeds(last_hidden_state=True)
    layouts = ("hydra",)  # headstart's own: docs/FORMATS.md, the Hydra section
    compiled = ("heads",)
    """What ``train.compile`` compiles (models/train_compile.py): each head."""

    def __init__(self, config: HydraConfig, step_weight: float = 0.8, labels: str = "target", chunk_tokens: int = 1024,
                 divergence: str = "kl") -> None:
        super().__init__()
        if labels not in ("target", "data"):
            raise ValueError(f"Hydra labels must be 'target' (distillation) or 'data', got {labels!r}")
        self.config, self.step_weight, self.labels = config, step_weight, labels
        self.chunk_tokens, self.divergence = chunk_tokens, divergence
        H, V = config.hidden_size, config.draft_vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, H)  # the target's, frozen; not saved
        self.embed_tokens.weight.requires_grad_(False)
        self.heads = nn.ModuleList(HydraHead(H, s + 2, config.num_layers, V) for s in range(config.num_heads))
        self.register_buffer("token_map", torch.arange(V, dtype=torch.int64) if config.truncated else None)
        self.teacher: Callable[[torch.Tensor], torch.Tensor] | None = None

    def activation_bytes(self, tokens: int, sequences: int, element_bytes: int) -> dict[str, int]:
        """headstart plan: head s keeps its (s+2)H-wide input and its ResBlocks' outputs per token; the losses run
        one head after another over chunks of the (possibly truncated) vocab."""
        c, H = self.config, self.config.hidden_size
        inputs = sum((s + 2) * H for s in range(c.num_heads)) * tokens * element_bytes
        blocks = c.num_heads * (c.num_layers * 3 + 1) * tokens * H * element_bytes
        return {f"head activations ({c.num_heads} heads)": inputs + blocks,
                "loss chunks": loss_chunk_bytes(self.chunk_tokens, c.draft_vocab_size, tokens)}

    # -- the target's pieces -----------------------------------------------------------------------
    def set_target(self, target) -> None:
        """Copy the target's input embedding; every lm_head starts as the target's (its token_map rows)."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(target.embed_tokens.weight.to(self.embed_tokens.weight.dtype))
            weight = target.lm_head_weight
            rows = weight if self.token_map is None else weight[self.token_map.to(weight.device)]
            for head in self.heads:
                head.lm_head.weight.copy_(rows.to(head.lm_head.weight.dtype))
        self.teacher = target.vocab_head()

    def set_token_map(self, token_map: torch.Tensor) -> None:
        ids = token_map.to(torch.int64)
        if self.token_map is None or ids.shape != self.token_map.shape or not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError(f"token_map must be {self.config.draft_vocab_size} strictly increasing target ids")
        self.token_map.copy_(ids)

    def target_vocab_ids(self) -> torch.Tensor:
        if self.token_map is not None:
            return self.token_map
        return torch.arange(self.config.vocab_size, device=self.heads[0].lm_head.weight.device)

    # -- inference ---------------------------------------------------------------------------------
    def logits_of(self, s: int, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Head s's logits [..., V'] from hidden [..., H] and the s+1 tokens before its own [..., s+1] (target ids:
        the bonus token, then the drafts of heads 0..s-1)."""
        z = torch.cat([hidden, self.embed_tokens(tokens).flatten(-2)], dim=-1)
        head = self.heads[s]
        return head.lm_head(head.features(z))

    # -- training ----------------------------------------------------------------------------------
    def forward(self, features: Features) -> tuple[torch.Tensor, dict[str, float]]:
        return self.loss(features)  # through forward: FSDP2 / ZeRO-3 hooks gather the parameters

    def loss(self, f: Features) -> tuple[torch.Tensor, dict[str, float]]:
        """Sum over heads of step_weight**s x head s's loss, each position t fed the data's tokens t+1..t+1+s."""
        if f.last_hidden_state is None:
            raise ValueError("Hydra heads read the target's final hidden state; the features carry none")
        if self.teacher is None:
            raise ValueError("Hydra training needs the target's lm_head (set_target) for soft labels and metrics")
        hidden = f.last_hidden_state
        embedded = self.embed_tokens(f.input_ids).to(hidden.dtype)  # [B, T, H]: E(x_t)
        # E(x_{t+1+j}) at position t, j = 0..K-1; positions past the end read zeros and are never trained
        later = [shift_left(embedded, 1 + j, 0.0) for j in range(self.config.num_heads)]

        def steps():
            for s, head in enumerate(self.heads):
                z = torch.cat([hidden, *later[: s + 1]], dim=-1)  # [B, T, (s + 2) H]
                yield VocabProjection(head.features, head.lm_head.weight), z

        return multi_step_loss(steps(), f, self.teacher, self.labels == "target", self.step_weight, self.chunk_tokens,
                               vocab_ids=self.token_map, divergence=self.divergence)

    # -- checkpoint --------------------------------------------------------------------------------
    def export_state_dict(self, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Every tensor but the target's embedding: heads.{s}.proj / block.layers.{j} / lm_head, token_map."""
        state = self.state_dict() if state is None else state
        return {k: v.detach().to("cpu").contiguous() for k, v in state.items() if not k.startswith("embed_tokens.")}

    def save_pretrained(self, directory: str | Path, dtype: torch.dtype = torch.bfloat16,
                        state_dict: dict[str, torch.Tensor] | None = None, layout: str | None = None,
                        verifier: dict | None = None) -> None:
        check_layout(self, layout)
        write_weights(directory, self.export_state_dict(state_dict), dtype, self.config.to_hf_dict(dtype))

    @classmethod
    def load(cls, directory: str | Path, target) -> "HydraHeads":
        """Finished heads for ``target`` (a Target or TargetMatrices), refused by name if they do not fit."""
        directory = Path(directory)
        if not (directory / "config.json").is_file() or not (directory / "model.safetensors").is_file():
            raise FileNotFoundError(f"{directory}: expected config.json and model.safetensors of Hydra heads")
        config = HydraConfig.from_hf_dict(json.loads((directory / "config.json").read_text()), str(directory / "config.json"))
        config.check_target(target.config, str(directory / "config.json"))
        model = cls(config)
        tensors = read_weights(directory, model.export_state_dict(), "Hydra")
        model.set_target(target)  # the embedding (not saved) and the teacher; the saved lm_heads replace its copies
        model.load_state_dict(tensors, strict=False)
        return model


def build_hydra(draft: DraftConfig, target, token_counts: torch.Tensor) -> HydraHeads:
    """Fresh Hydra heads for ``target``, starting from its embedding and lm_head."""
    options = draft.options or HydraOptions()
    if draft.config:
        config = HydraConfig.from_hf_dict(json.loads(Path(draft.config).read_text()), draft.config)
    else:
        config = HydraConfig.from_target(target.config, options)
    config.check_target(target.config)
    if draft.loss != "kl" and options.labels != "target":
        raise ValueError(f"draft.loss={draft.loss!r} compares the heads with the target's distribution; it needs "
                         "draft.labels=target, not data")
    heads = HydraHeads(config, step_weight=options.step_weight, labels=options.labels,
                       chunk_tokens=draft.loss_chunk_tokens, divergence=draft.loss)
    if config.truncated:  # the most frequent trained tokens, ascending (EAGLE-3's draft vocab rule)
        _, t2d = build_draft_vocab(token_counts, config.draft_vocab_size)
        heads.set_token_map(t2d.nonzero().squeeze(1))
    heads.set_target(target)
    return heads


def detect_hydra(directory: Path, config: dict) -> str | None:
    """The layout of an exported head whose config.json is ``config``, if it is Hydra's."""
    return "hydra" if config.get("architectures") == ["HydraModel"] else None
