#!/usr/bin/env bash
# The real target: SmolLM2-135M-Instruct's committed heads and n-gram lookup on MT-bench (first question per
# category, all turns, 128 new tokens, greedy, output checked identical to plain greedy decoding): chains
# k = 2..6 (Medusa: up to its 4 heads), and trees -- EAGLE-2's default dynamic tree (depth 6, top-k 8, 48 tokens)
# and a small one (depth 5, top-k 4, 12 tokens: on a CPU the verify forward's cost grows with every tree token),
# or a head's fitted static tree (configs/smollm2/<head>-tree.json). One benchmark at a time: nothing else may
# run meanwhile. Tables go to the notes file named (runs/lab-notes.md).
#   benchmarks/bench_smollm2.sh [OUT_DIR]            HEADS="eagle3 medusa" picks the heads (the default)
set -euo pipefail
X=${1:-runs/bench-smollm2}
T=${TARGET:-targets/SmolLM2-135M-Instruct}
B="python scripts/benchmark.py --target $T --questions configs/demo/eval/mt_bench.jsonl --per-category 1 \
  --max-new-tokens 128 --no-hf-reference --verify-greedy"
runs=()
for m in ${HEADS:-eagle3 medusa} ngram; do
  draft=(); [ "$m" = ngram ] || draft=(--draft "configs/smollm2/$m-head")
  max_k=6; [ "$m" = medusa ] && max_k=$(python -c "import json; print(json.load(open('configs/smollm2/medusa-head/config.json'))['num_heads'])")
  for k in $(seq 2 "$max_k"); do
    $B --method "$m" "${draft[@]}" --num-speculative-tokens "$k" --out "$X/$m-k$k"
    runs+=("$X/$m-k$k")
  done
  if [ -f "configs/smollm2/$m-tree.json" ]; then
    $B --method "$m" "${draft[@]}" --tree-paths "configs/smollm2/$m-tree.json" --out "$X/$m-tree"
    runs+=("$X/$m-tree")
  elif [ "$m" != ngram ]; then
    $B --method "$m" "${draft[@]}" --tree --out "$X/$m-tree48"
    $B --method "$m" "${draft[@]}" --tree --tree-depth 5 --tree-topk 4 --tree-total-tokens 12 --out "$X/$m-tree12"
    runs+=("$X/$m-tree48" "$X/$m-tree12")
  fi
done
python benchmarks/compare_methods.py "${runs[@]}" --benchmarks runs/lab-notes.md --title "Real target: SmolLM2-135M-Instruct" \
  --script '`benchmarks/bench_smollm2.sh`' --note "${NOTE:-}"
