"""Data, features and the training loop."""
