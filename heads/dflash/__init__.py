"""DFlash: a block-diffusion drafter reading the target's hidden states, filling a block of masked positions at once."""
