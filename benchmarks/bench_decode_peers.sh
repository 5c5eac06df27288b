#!/usr/bin/env bash
# headstart's drafters next to transformers' own speculative decoding, in one sequence, on MT-bench (first question
# per category, all turns, greedy chain k=4, 128 new tokens, output checked identical to plain greedy decoding), with
# where each round's time goes. Demo target: EAGLE-3 head, the 2-layer draft model through headstart's loop and
# through transformers' assisted generation, n-gram vs transformers' prompt lookup. SmolLM2 (TARGET_SMOLLM2, skipped
# when absent): EAGLE-3 head, n-gram vs prompt lookup (no smaller model with its tokenizer is at hand, so no draft
# model). One benchmark at a time: nothing else may run meanwhile. Tables go to the notes file named (runs/lab-notes.md).
#   benchmarks/bench_decode_peers.sh [OUT_DIR]
set -euo pipefail
X=${1:-runs/bench-peers}
Q="--questions configs/demo/eval/mt_bench.jsonl --per-category 1 --max-new-tokens 128 --num-speculative-tokens 4 \
  --no-hf-reference --verify-greedy"
D=configs/demo/target
python scripts/benchmark.py --target $D $Q --method eagle3 --draft configs/demo/eagle3-head --out $X/demo-eagle3
python scripts/benchmark.py --target $D $Q --method draft-model --draft configs/demo/draft-model --out $X/demo-draft-model
python scripts/benchmark.py --target $D $Q --method hf-assisted --draft configs/demo/draft-model --out $X/demo-hf-assisted
python scripts/benchmark.py --target $D $Q --method ngram --out $X/demo-ngram
python scripts/benchmark.py --target $D $Q --method hf-prompt-lookup --out $X/demo-hf-prompt-lookup
python benchmarks/compare_methods.py $X/demo-{eagle3,draft-model,hf-assisted,ngram,hf-prompt-lookup} --benchmarks runs/lab-notes.md \
  --title "Decoding: headstart's loop vs transformers' (demo target)" --script '`benchmarks/bench_decode_peers.sh`' \
  --note "${NOTE_DEMO:-}"
S=${TARGET_SMOLLM2:-targets/SmolLM2-135M-Instruct}
if [ -f "$S/config.json" ]; then
  python scripts/benchmark.py --target $S $Q --method eagle3 --draft configs/smollm2/eagle3-head --out $X/smollm2-eagle3
  python scripts/benchmark.py --target $S $Q --method ngram --out $X/smollm2-ngram
  python scripts/benchmark.py --target $S $Q --method hf-prompt-lookup --out $X/smollm2-hf-prompt-lookup
  python benchmarks/compare_methods.py $X/smollm2-{eagle3,ngram,hf-prompt-lookup} --benchmarks runs/lab-notes.md \
    --title "Decoding: headstart's loop vs transformers' (SmolLM2-135M-Instruct)" --script '`benchmarks/bench_decode_peers.sh`' \
    --note "${NOTE_SMOLLM2:-}"
fi
