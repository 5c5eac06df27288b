"""The results pipeline and a few measuring drivers; no user command needs them. run.py runs named suites of
``headstart bench`` and training runs, heads_side_by_side.py and plan_vs_measured.py collect runs into result files
(benchmarks/results/; record.py: each with its command, commit, machine and date), results_page.py writes
BENCHMARKS.md from them. The other drivers measure one thing each and write a table (record.py ``write_table``)."""
