"""Draft heads: one folder per head (its module, options, drafter, checker, layouts and catalog entry) and the
catalog that lists them (registry.py)."""
