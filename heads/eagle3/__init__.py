"""EAGLE-3 (Li et al., 2025): a one-layer draft over the target's fused aux hidden states, trained with the
training-time test."""
