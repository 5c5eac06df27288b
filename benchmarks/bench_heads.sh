#!/usr/bin/env bash
# The committed heads of a target, each decoded on MT-bench's first question per category (every turn, 128 new
# tokens, greedy, checked token for token against plain greedy decoding), then collected into one result file under
# benchmarks/results/ that BENCHMARKS.md is generated from. One benchmark at a time: nothing else may run meanwhile.
#   benchmarks/bench_heads.sh demo    [RUN_DIR]   ~15 min on a 2-core CPU
#   benchmarks/bench_heads.sh smollm2 [RUN_DIR]   ~40 min (needs targets/SmolLM2-135M-Instruct: scripts/import_gguf.py)
#   python benchmarks/results_page.py             then rewrites BENCHMARKS.md
# ONLY="eagle3-chain ngram-chain" runs just those; the result file collects whatever RUN_DIR holds.
set -u
WHICH=${1:?demo or smollm2}
X=${2:-runs/bench-heads-$WHICH}
mkdir -p "$X"
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
case $WHICH in
  demo) T=configs/demo/target; H=configs/demo; MEDUSA_TREE=configs/trees/medusa-demo-32.json; NAME="the demo target" ;;
  smollm2) T=targets/SmolLM2-135M-Instruct; H=configs/smollm2; MEDUSA_TREE=configs/smollm2/medusa-tree.json
           NAME="SmolLM2-135M-Instruct" ;;
  *) echo "bench_heads.sh: expected demo or smollm2, got $WHICH" >&2; exit 2 ;;
esac
bench() {  # NAME FLAGS...
  local name=$1; shift
  want "$name" || return 0
  echo "== $name $(date +%T)"
  python scripts/benchmark.py --target "$T" --questions configs/demo/eval/mt_bench.jsonl --per-category 1 \
    --max-new-tokens 128 --no-hf-reference --verify-greedy "$@" --out "$X/$name" > "$X/$name.log" 2>&1 \
    || { echo "FAILED or not greedy-exact: $name (see $X/$name.log)"; return 0; }
  grep "^| overall" "$X/$name/results.md" | head -1
}
bench eagle3-chain --method eagle3 --draft $H/eagle3-head --num-speculative-tokens 4
bench eagle3-tree --method eagle3 --draft $H/eagle3-head --tree
bench medusa-chain --method medusa --draft $H/medusa-head --num-speculative-tokens 4
bench medusa-tree --method medusa --draft $H/medusa-head --tree-paths $MEDUSA_TREE
bench mtp-chain --method mtp --draft $H/mtp-head --num-speculative-tokens 4
bench ngram-chain --method ngram --num-speculative-tokens 4
if [ "$WHICH" = demo ]; then
  bench draft-model-chain --method draft-model --draft configs/demo/draft-model --num-speculative-tokens 4
else
  bench eagle3-2k-chain --method eagle3 --draft configs/smollm2/eagle3-2k-head --num-speculative-tokens 4
fi
runs=()
for d in "$X"/*/; do [ -f "$d/results.json" ] && runs+=(--bench "$(basename "$d")=$d"); done
python benchmarks/heads_side_by_side.py --title "The committed heads of $NAME" \
  --what "Every committed head of $NAME ($H/*-head) and the drafters that need no training, each decoded alone: MT-bench's first question per category (every turn), 128 new tokens, greedy, token for token plain greedy decoding's output" \
  "${runs[@]}" --out "benchmarks/results/${WHICH}_committed_heads.json"
