"""Modules: the frozen target wrapper and the draft heads."""
