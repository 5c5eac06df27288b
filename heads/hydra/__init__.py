"""Hydra heads: Medusa heads that read the tokens already drafted (heads/hydra/module.py)."""
