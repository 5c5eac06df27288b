"""Which of the target's layers a draft may read when a server runs it: the aux layer ids vLLM and SGLang capture."""

from __future__ import annotations

from headstart.models.target import check_aux_layer_ids


def check_servable_ids(layer_ids, num_layers: int) -> tuple[int, ...]:
    """Aux layer ids the servers can capture: id 0 (the embeddings) is not one -- vLLM and SGLang take
    ``hidden_states + residual`` before layer k, and before layer 0 there is no residual yet."""
    ids = check_aux_layer_ids(layer_ids, num_layers)
    if 0 in ids:
        raise ValueError(f"aux layer id 0 (the embeddings) cannot be captured by vLLM or SGLang; use ids in 1..{num_layers - 1}")
    return ids
