#!/usr/bin/env bash
# Every drafter on the same MT-bench questions (first per category, all turns, 64 new tokens, greedy):
# the Medusa demo heads (chain, fitted static tree), the MTP demo layer (chain, dynamic tree) and the
# layer trained with one unrolled step, the EAGLE-3 demo head (chain, dynamic tree), n-gram lookup and
# the demo draft model. One benchmark at a time: nothing else may run meanwhile.
# Numbers: BENCHMARKS.md ("Heads side by side"). About 20 minutes on a 2-core CPU.
set -euo pipefail
X=${1:-runs/bench-heads}
NOTE=${2:-}
B="python scripts/benchmark.py --target configs/demo/target --questions configs/demo/eval/mt_bench.jsonl --per-category 1 \
  --max-new-tokens 64 --no-hf-reference --verify-greedy"
$B --method medusa --draft configs/demo/medusa-head --num-speculative-tokens 4 --out $X/medusa-chain
$B --method medusa --draft configs/demo/medusa-head --tree-paths configs/trees/medusa-demo-32.json --out $X/medusa-tree
$B --method mtp --draft configs/demo/mtp-head --num-speculative-tokens 4 --out $X/mtp-chain
$B --method mtp --draft configs/demo/mtp-head --tree --out $X/mtp-tree
$B --method mtp --draft ${MTP_UNROLL1:-runs/demo-mtp-unroll1/final} --num-speculative-tokens 4 --out $X/mtp-unroll1-chain
$B --method eagle3 --draft configs/demo/eagle3-head --num-speculative-tokens 4 --out $X/eagle3-chain
$B --method eagle3 --draft configs/demo/eagle3-head --tree --out $X/eagle3-tree
$B --method ngram --num-speculative-tokens 4 --out $X/ngram-chain
$B --method draft-model --draft configs/demo/draft-model --num-speculative-tokens 4 --out $X/draft-model-chain
python benchmarks/compare_methods.py $X/medusa-chain $X/medusa-tree $X/mtp-chain $X/mtp-tree $X/mtp-unroll1-chain \
  $X/eagle3-chain $X/eagle3-tree $X/ngram-chain $X/draft-model-chain --benchmarks BENCHMARKS.md \
  --title "Heads side by side: Medusa, MTP, EAGLE-3, n-gram, draft model" --note "$NOTE"
