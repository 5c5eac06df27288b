#!/usr/bin/env bash
# All trained drafts of a target side by side, with the drafters that need no training: each decoded alone on MT-bench's
# first question per category (every turn, 128 new tokens, greedy, checked token for token against plain greedy
# decoding), chains of 4 (and trees where the head has them), then collected with each head's training record (its
# card: steps, data, last evaluation) into one result file under benchmarks/results/ that BENCHMARKS.md is generated
# from. One benchmark at a time: nothing else may run meanwhile.
#   benchmarks/bench_heads.sh demo    [RUN_DIR]   ~5 min on a 2-core CPU
#   benchmarks/bench_heads.sh smollm2 [RUN_DIR]   ~50 min (needs targets/SmolLM2-135M-Instruct: scripts/import_gguf.py;
#       its EAGLE-3.1, P-EAGLE and DFlash heads are not committed: benchmarks/bench_new_heads_full.sh smollm2 makes
#       them under runs/new-heads-smollm2, and rows for them are run when they are there)
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
  N=$H  # the 2026 heads, committed
  bench draft-model-chain --method draft-model --draft configs/demo/draft-model --num-speculative-tokens 4
  bench distilled-draft-model-chain --method draft-model --draft configs/demo/distilled-draft-model --num-speculative-tokens 4
  bench hydra-chain --method hydra --draft $H/hydra-head --num-speculative-tokens 4
  bench hydra-tree --method hydra --draft $H/hydra-head --tree --tree-depth 4
else
  N=runs/new-heads-smollm2  # the 2026 heads, published there by benchmarks/bench_new_heads_full.sh smollm2
  bench eagle3-2k-chain --method eagle3 --draft configs/smollm2/eagle3-2k-head --num-speculative-tokens 4
  bench early-exit-chain --method early-exit --draft $H/early-exit-head --num-speculative-tokens 4
fi
[ -d $N/eagle31-head ] && bench eagle31-chain --method eagle3 --draft $N/eagle31-head --num-speculative-tokens 4
[ -d $N/peagle-head ] && bench peagle-chain --method peagle --draft $N/peagle-head --num-speculative-tokens 4
[ -d $N/dflash-head ] && bench dflash-chain --method dflash --draft $N/dflash-head --num-speculative-tokens 4
runs=() train=()
for d in "$X"/*/; do
  [ -f "$d/results.json" ] || continue
  name=$(basename "$d"); runs+=(--bench "$name=$d")
  head=$(python -c "import json, sys; print(json.load(open(sys.argv[1]))['args'].get('draft') or '')" "$d/results.json")
  # its card's training record, once per head (a chain and a tree of one head share it)
  [ -n "$head" ] && [ -f "$head/eval_metrics.json" ] && [[ " ${train[*]} " != *"=$head "* ]] &&
    train+=(--train "$(basename "$head")=$head")
done
python benchmarks/heads_side_by_side.py --title "All trained drafts side by side" \
  --what "Every trained draft of $NAME (the committed heads $H/*-head and draft models, and the 2026 heads where they were trained) and the drafters that need no training, each decoded alone: MT-bench's first question per category (every turn), 128 new tokens, greedy, token for token plain greedy decoding's output; training as each head's card records it (its recipe's data, steps and batch), and its time where an earlier result file timed the run it was published from" \
  "${train[@]}" "${runs[@]}" $(for f in benchmarks/results/*.json; do case $f in *_all_drafts.json) ;; *) echo "--times-from $f" ;; esac; done) \
  --out "benchmarks/results/${WHICH}_all_drafts.json"
