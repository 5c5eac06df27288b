"""headstart: train speculative-decoding draft heads against a frozen Hugging Face target."""

__version__ = "0.2.0"  # the one version string (pyproject reads it)
