"""Tiny random-init HF causal LMs of several families, built from configs: nothing is downloaded."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

COMMON = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
FAMILY_EXTRAS = {
    "llama": {},
    "qwen2": {},
    "qwen3": {"head_dim": 8},
    "mistral": {"sliding_window": None},
    "gemma2": {"head_dim": 8, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "sliding_window": 16},
    "gemma3_text": {"head_dim": 8, "final_logit_softcapping": 30.0, "sliding_window": 16},
    "phi3": {"pad_token_id": 0},
    "qwen3_moe": {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "decoder_sparse_step": 1, "mlp_only_layers": []},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
}
FAMILIES = sorted(FAMILY_EXTRAS)


def tiny_causal_lm(family: str, **overrides) -> PreTrainedModel:
    config = AutoConfig.for_model(family, **{**COMMON, **FAMILY_EXTRAS[family], **overrides})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def randomize(module, seed: int = 0, std: float = 0.2) -> None:
    """Random trained weights, norms included (around 1): a norm left at ones, or a tensor swapped, would not show."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.requires_grad:
                p.normal_(1.0 if "norm" in name else 0.0, 0.3 if "norm" in name else std, generator=g)


def random_peagle_head(target, draft_vocab_size: int = 48, parallel_tokens: int = 4, mask_token_id: int | None = None,
                       fc_norm: bool = False, seed: int = 0, aux_layer_ids=None, num_layers: int = 1, **kwargs):
    """An untrained P-EAGLE head for ``target`` with a random draft vocab and random weights (its norms' too)."""
    import torch

    from headstart.models.draft_vocab import build_draft_vocab
    from headstart.heads.peagle.module import PEagleConfig, PEagleDraft

    config = PEagleConfig.from_target(target.config, draft_vocab_size, aux_layer_ids, fc_norm=fc_norm, mask_token_id=mask_token_id,
                                      parallel_tokens=parallel_tokens, num_layers=num_layers)
    head = PEagleDraft(config, ttt_steps=parallel_tokens, **kwargs)
    randomize(head, seed)
    g = torch.Generator().manual_seed(seed)
    head.set_draft_vocab(*build_draft_vocab(torch.randint(0, 9, (target.vocab_size,), generator=g), draft_vocab_size))
    head.load_target_embeddings(target.embed_tokens.weight)
    return head


def random_eagle3_head(target, draft_vocab_size: int = 48, counts_seed: int | None = None, aux_layer_ids=None,
                       fc_norm: bool = False, norm_output: bool = False, num_layers: int = 1, **kwargs):
    """An untrained EAGLE-3 head for ``target`` (a headstart Target) with a random draft vocab; ``fc_norm`` and
    ``norm_output``: EAGLE-3.1's norms; ``num_layers``: its decoder layers."""
    import torch

    from headstart.models.draft_vocab import build_draft_vocab
    from headstart.heads.eagle3.module import Eagle3Config, Eagle3Draft

    config = Eagle3Config.from_target(target.config, draft_vocab_size, aux_layer_ids, fc_norm=fc_norm, norm_output=norm_output,
                                      num_layers=num_layers)
    head = Eagle3Draft(config, **kwargs)
    g = None if counts_seed is None else torch.Generator().manual_seed(counts_seed)
    head.set_draft_vocab(*build_draft_vocab(torch.randint(0, 9, (target.vocab_size,), generator=g), draft_vocab_size))
    head.load_target_embeddings(target.embed_tokens.weight)
    return head


def random_features(target, B: int = 2, T: int = 19, seed: int = 1, cut: int = 14):
    """A batch of random token ids with a random loss mask (row 1 untrained from ``cut`` on) and the target's final
    hidden states: what a head that reads only those (Medusa, Hydra, a draft model) trains on."""
    from headstart.models.head import Features

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    mask[1, cut:] = 0
    return Features(input_ids=ids, loss_mask=mask, last_hidden_state=target(ids).last_hidden_state)

