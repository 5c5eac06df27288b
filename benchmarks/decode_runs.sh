# Sourced by the decode-table scripts (bench_decode_gpu.sh, smollm2_gpu.sh): the MT-bench setting of every decode
# table (first question per category, all turns, 128 new tokens, greedy, output checked identical to plain greedy
# decoding; QUESTIONS="--questions FILE ..." replaces the question arguments) and a runner that reports a failed or inexact run and still tables it when it wrote results.
#   decode_run TARGET OUT_DIR NAME BENCHMARK_ARGS...    (appends OUT_DIR/NAME to the array `runs`)
# On a leased machine: DEADLINE (epoch seconds) skips the runs that would start after it, RUN_S stops a run after
# that many seconds (its table row is then missing), so a lease's last minutes still bring back the finished runs;
# ONLY="NAME ..." runs just the named runs (a short lease's choice, e.g. ONLY="eagle3-k4-compiled ngram-k4-compiled").
runs=()
decode_run() {
  local target=$1 dir=$2 name=$3; shift 3
  if [ -n "${DEADLINE:-}" ] && [ "$(date +%s)" -ge "$DEADLINE" ]; then echo "skipped (past DEADLINE): $name"; return 0; fi
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return 0; fi
  # shellcheck disable=SC2086  # QUESTIONS (the questions' arguments) and EXTRA (extra arguments), split on spaces
  ${RUN_S:+timeout "$RUN_S"} python scripts/benchmark.py --target "$target" ${QUESTIONS:---questions configs/demo/eval/mt_bench.jsonl --per-category 1} \
    --max-new-tokens 128 --no-hf-reference --verify-greedy "$@" ${EXTRA:-} --out "$dir/$name" \
    || echo "FAILED or not greedy-exact: $name"
  [ -f "$dir/$name/results.json" ] && runs+=("$dir/$name")
  return 0
}
