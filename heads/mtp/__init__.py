"""MTP: a multi-token-prediction layer (DeepSeek-V3 style) run recurrently as a draft."""
