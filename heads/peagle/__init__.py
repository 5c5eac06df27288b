"""P-EAGLE: EAGLE-3 that drafts all k tokens in one forward (parallel drafting)."""
