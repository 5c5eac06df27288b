"""Lab and benchmark drivers: result files for BENCHMARKS.md (benchmarks/results/, results_page.py) and lab notes;
no user command needs them."""
