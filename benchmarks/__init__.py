"""Lab and benchmark drivers that write BENCHMARKS.md; no user command needs them."""
