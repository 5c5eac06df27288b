#!/usr/bin/env bash
# Online vs offline EAGLE-3 training on the demo target (GSM8K rows, the main job's 150 steps):
# the same recipe trained online, from the default store (fp8 aux + top-32) and from the lossless
# one (bf16 aux + final hidden); then tau on the recipe's held-out prompts and on MT-bench.
# Tables go to the notes file named (runs/lab-notes.md). About 45 minutes on a 2-core CPU.
set -euo pipefail
X=${1:-runs/offline-exp}
COMMON="--config configs/demo/eagle3.yaml --data.files=[configs/demo/data/gsm8k_train.jsonl] --logging.progress=false"
TRAIN="torchrun --nproc_per_node 2 scripts/train_eagle3.py $COMMON"
GEN="torchrun --nproc_per_node 2 scripts/generate_features.py $COMMON"
$TRAIN --output_dir=$X/online
$GEN --features.path=$X/feat-fp8-topk
$TRAIN --output_dir=$X/offline-fp8-topk --features.path=$X/feat-fp8-topk
$GEN --features.path=$X/feat-bf16-hidden --features.aux=bf16 --features.target_dist=hidden
$TRAIN --output_dir=$X/offline-bf16-hidden --features.path=$X/feat-bf16-hidden
python benchmarks/heldout_tau.py $COMMON --heads $X/online/final $X/offline-fp8-topk/final $X/offline-bf16-hidden/final
for h in online offline-fp8-topk offline-bf16-hidden; do
  python scripts/benchmark.py --target configs/demo/target --questions configs/demo/eval/mt_bench.jsonl --per-category 3 \
    --max-new-tokens 64 --method eagle3 --draft $X/$h/final --num-speculative-tokens 4 --no-hf-reference --out $X/bench-$h
done
# Ten times more shards for the time-to-first-step measurement (benchmarks/bench_features.py).
$GEN --features.path=$X/feat-fp8-topk-x10 --features.samples_per_shard=25
python benchmarks/bench_features.py $COMMON --stores $X/feat-fp8-topk $X/feat-fp8-topk-x10 --out runs/lab-notes.md
