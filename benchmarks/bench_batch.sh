#!/usr/bin/env bash
# Plain vs speculative decoding by batch size: every chain drafter (the demo EAGLE-3, MTP and Medusa heads, the demo
# draft model, n-gram lookup) at --batch-size 1, 4 and 16 on the same MT-bench questions (first 2 per category = 16
# questions, all turns, 64 new tokens, chain k=4, greedy, output checked equal to plain greedy decoding). tau is per
# sequence; tokens/s are over the batch, plain and speculative on the same runner. One benchmark at a time: nothing
# else may run meanwhile. Tables go to the notes file named (runs/lab-notes.md).
#   benchmarks/bench_batch.sh [OUT_DIR] [TARGET]      (BATCHES="1 4 16", METHODS="eagle3 mtp medusa draft-model ngram")
set -euo pipefail
X=${1:-runs/bench-batch}
TARGET=${2:-configs/demo/target}
declare -A DRAFT=([eagle3]=configs/demo/eagle3-head [mtp]=configs/demo/mtp-head [medusa]=configs/demo/medusa-head
                  [draft-model]=configs/demo/draft-model [ngram]=)
runs=()
for method in ${METHODS:-eagle3 mtp medusa draft-model ngram}; do
  for b in ${BATCHES:-1 4 16}; do
    draft=${DRAFT[$method]:-}
    # DEADLINE (epoch seconds): skip the runs that would start after it (a leased GPU's last minutes)
    if [ -n "${DEADLINE:-}" ] && [ "$(date +%s)" -ge "$DEADLINE" ]; then echo "skipped (past DEADLINE): $method-b$b"; continue; fi
    # shellcheck disable=SC2086  # EXTRA: extra benchmark.py arguments, split on spaces
    ${RUN_S:+timeout "$RUN_S"} python scripts/benchmark.py --target "$TARGET" --method "$method" ${draft:+--draft $draft} \
      --questions configs/demo/eval/mt_bench.jsonl --per-category ${PER_CATEGORY:-2} --max-new-tokens ${MAX_NEW:-64} \
      --num-speculative-tokens 4 --no-hf-reference --verify-greedy --batch-size "$b" ${EXTRA:-} --out "$X/$method-b$b" \
      || echo "FAILED or not greedy-exact: $method-b$b"
    [ -f "$X/$method-b$b/results.json" ] && runs+=("$X/$method-b$b")
  done
done
python benchmarks/compare_methods.py "${runs[@]}" ${BENCHMARKS:+--benchmarks $BENCHMARKS} \
  --title "${TITLE:-Decoding by batch size}" --script '`benchmarks/bench_batch.sh`' --note "${NOTE:-}"
