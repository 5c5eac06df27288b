"""What every layer builds on: the frozen target and its matrices, the head contract (models/head.py), shared losses and
kernels, TTT attention, the draft vocab, provenance, export, file and error helpers. No head lives here (heads/)."""
