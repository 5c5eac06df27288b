"""headstart: train speculative-decoding draft heads against a frozen Hugging Face target."""

__version__ = "0.1.0"
