#!/usr/bin/env bash
# Decoding on a GPU (issue 23's GPU table): the demo target in bf16 with each of its heads (chain k=4 and a tree),
# headstart's draft-model and n-gram drafters, and transformers' assisted generation and prompt lookup, on
# MT-bench (first question per category, all turns, 128 new tokens, greedy, output checked identical to plain
# greedy decoding), batch 1, eager; then headstart's drafters again with --compile (the target's forward and the
# drafter's step compiled, CUDA graphs), each next to its eager run in a second table (COMPILED=0 skips it;
# COMPILED_RUNS picks which). DEADLINE and RUN_S (decode_runs.sh) fit the runs into a lease.
# Speed-up = plain / speculative time on the same runner. The real target's GPU table comes from
# benchmarks/smollm2_gpu.sh. Needs a CUDA GPU (benchmark.py picks it and bf16 by itself).
#   benchmarks/bench_decode_gpu.sh [OUT_DIR] [BENCHMARKS_FILE]
set -euo pipefail
X=${1:-runs/bench-decode-gpu}
M=${2:-runs/lab-notes.md}
D=${TARGET:-configs/demo/target}
source "$(dirname "$0")/decode_runs.sh"
run() { decode_run "$D" "$X" "$@"; }
run eagle3-k4 --method eagle3 --draft configs/demo/eagle3-head --num-speculative-tokens 4
run eagle3-tree --method eagle3 --draft configs/demo/eagle3-head --tree
run mtp-k4 --method mtp --draft configs/demo/mtp-head --num-speculative-tokens 4
run medusa-k4 --method medusa --draft configs/demo/medusa-head --num-speculative-tokens 4
run draft-model-k4 --method draft-model --draft configs/demo/draft-model --num-speculative-tokens 4
run hf-assisted-k4 --method hf-assisted --draft configs/demo/draft-model --num-speculative-tokens 4
run ngram-k4 --method ngram --num-speculative-tokens 4
run hf-prompt-lookup-k4 --method hf-prompt-lookup --num-speculative-tokens 4
python benchmarks/compare_methods.py "${runs[@]}" --benchmarks "$M" \
  --title "Decoding on a GPU: demo target, bf16, batch 1, eager" --script '`benchmarks/bench_decode_gpu.sh`' \
  --note "${NOTE:-}"
if [ "${COMPILED:-1}" != 0 ]; then
  eager=("${runs[@]}")
  runs=()
  for m in ${COMPILED_RUNS:-eagle3-k4 mtp-k4 medusa-k4 draft-model-k4 ngram-k4}; do
    for r in "${eager[@]}"; do [ "$(basename "$r")" = "$m" ] && runs+=("$r"); done
    case $m in
      eagle3-k4) run eagle3-k4-compiled --method eagle3 --draft configs/demo/eagle3-head --num-speculative-tokens 4 --compile --max-len 1024 ;;
      mtp-k4) run mtp-k4-compiled --method mtp --draft configs/demo/mtp-head --num-speculative-tokens 4 --compile --max-len 1024 ;;
      medusa-k4) run medusa-k4-compiled --method medusa --draft configs/demo/medusa-head --num-speculative-tokens 4 --compile --max-len 1024 ;;
      draft-model-k4) run draft-model-k4-compiled --method draft-model --draft configs/demo/draft-model --num-speculative-tokens 4 --compile --max-len 1024 ;;
      ngram-k4) run ngram-k4-compiled --method ngram --num-speculative-tokens 4 --compile --max-len 1024 ;;
    esac
  done
  python benchmarks/compare_methods.py "${runs[@]}" --benchmarks "$M" \
    --title "Decoding on a GPU: demo target, bf16, batch 1, eager vs compiled (CUDA graphs)" \
    --script '`benchmarks/bench_decode_gpu.sh`' --note "${NOTE_COMPILED:-}"
fi
