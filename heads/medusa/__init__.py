"""Medusa (Cai et al., 2024): k residual heads on the target's last hidden state, head i predicting token t+i+2."""
