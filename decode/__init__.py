"""Speculative generation and acceptance benchmarks."""
