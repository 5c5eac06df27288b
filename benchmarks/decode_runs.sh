# Sourced by the decode-table scripts (bench_decode_gpu.sh, smollm2_gpu.sh): the MT-bench setting of every decode
# table (first question per category, all turns, 128 new tokens, greedy, output checked identical to plain greedy
# decoding) and a runner that reports a failed or inexact run and still tables it when it wrote results.
#   decode_run TARGET OUT_DIR NAME BENCHMARK_ARGS...    (appends OUT_DIR/NAME to the array `runs`)
runs=()
decode_run() {
  local target=$1 dir=$2 name=$3; shift 3
  # shellcheck disable=SC2086  # EXTRA: extra benchmark.py arguments, split on spaces
  python scripts/benchmark.py --target "$target" --questions configs/demo/eval/mt_bench.jsonl --per-category 1 \
    --max-new-tokens 128 --no-hf-reference --verify-greedy "$@" ${EXTRA:-} --out "$dir/$name" \
    || echo "FAILED or not greedy-exact: $name"
  [ -f "$dir/$name/results.json" ] && runs+=("$dir/$name")
  return 0
}
