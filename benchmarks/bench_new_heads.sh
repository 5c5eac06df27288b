#!/usr/bin/env bash
# The 2026 heads against EAGLE-3 on the demo target at one budget: the quick-start recipe (the demo datasets, 150
# steps, global batch 8 = 4 x 2 ranks), each head trained alone (GNU time logs its wall time and peak memory), then
# each pair decoded in ONE process, turn by turn (scripts/benchmark.py --versus): MT-bench's first question per
# category, 128 tokens, greedy-exact, chains. One run at a time, nothing else running.
#   benchmarks/bench_new_heads.sh [OUT_DIR]       ONLY="train-eagle3 ..." runs just those steps
# then benchmarks/heads_side_by_side.py collects the runs into one result file (its --help).
set -u
X=${1:-runs/new-heads}
MT="--target configs/demo/target --questions configs/demo/eval/mt_bench.jsonl --per-category 1"
COMMON="--max-new-tokens 128 --no-hf-reference --verify-greedy"
mkdir -p "$X"
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
train() {  # NAME RECIPE [overrides...]
  local name=$1 recipe=$2; shift 2
  want "train-$name" || return 0
  echo "== train $name $(date +%T)"
  /usr/bin/time -v torchrun --nproc_per_node 2 scripts/train_eagle3.py --config "$recipe" --output_dir="$X/$name" \
    --logging.progress=false "$@" > "$X/$name.time" 2>&1 || echo "FAILED: train $name"
}
pair() {  # NAME FLAGS...
  local name=$1; shift
  want "$name" || return 0
  echo "== $name $(date +%T)"
  # shellcheck disable=SC2086
  python scripts/benchmark.py $MT $COMMON "$@" --out "$X/$name" > "$X/$name.log" 2>&1 || echo "FAILED or not greedy-exact: $name"
  grep "Paired" "$X/$name.log"
}
train eagle3 configs/demo/eagle3.yaml
train peagle configs/demo/peagle.yaml
train dflash configs/demo/dflash.yaml
train dflash-dpace configs/demo/dflash.yaml --draft.weighting=dpace
for k in 3 4 5 6; do
  pair "peagle-k$k" --method peagle --draft "$X/peagle/final" --num-speculative-tokens "$k" \
    --versus "--method eagle3 --draft $X/eagle3/final --num-speculative-tokens $k"
done
pair peagle-k4-predict --method peagle --draft "$X/peagle/final" --num-speculative-tokens 4 --predict
pair eagle3-k4-predict --method eagle3 --draft "$X/eagle3/final" --num-speculative-tokens 4 --predict
for k in 4 7; do
  pair "dflash-k$k" --method dflash --draft "$X/dflash/final" --num-speculative-tokens "$k" \
    --versus "--method eagle3 --draft $X/eagle3/final --num-speculative-tokens $k"
done
pair dflash-dpace-k7 --method dflash --draft "$X/dflash-dpace/final" --num-speculative-tokens 7 \
  --versus "--method dflash --draft $X/dflash/final --num-speculative-tokens 7"
