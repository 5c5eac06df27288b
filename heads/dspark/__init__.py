"""DSpark: a DFlash block drafter with a Markov bias from each draft's previous token and a confidence head."""
