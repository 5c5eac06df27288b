#!/usr/bin/env bash
# Early-exit self-speculation on SmolLM2-135M-Instruct: a sweep of the exit layer E. One feature store carries the
# hidden states after layers 6, 10, 15 and 20 (configs/smollm2/early_exit.yaml); an adapter is trained for each E from
# it, alone under GNU time, and decoded paired with the committed EAGLE-3 head in one process (--versus) at the same k:
# MT-bench's first question per category, every turn, 128 new tokens, greedy-exact, chains. The best E's adapter
# (BEST=E) is published as configs/smollm2/early-exit-head.
#   benchmarks/bench_early_exit.sh        ONLY="train-6 pair-6 collect" runs just those steps
#   STEPS=150 benchmarks/bench_early_exit.sh   trains each E for 150 steps instead of the recipe's 450 (the sweep)
# ~9 min for the store, ~3.5 min per paired decode on a 2-core CPU; nothing else may run meanwhile.
set -u
X=runs/early-exit-smollm2
T=targets/SmolLM2-135M-Instruct
R=configs/smollm2/early_exit.yaml
SWEEP=${SWEEP:-"6 10 15 20"}
STEPS=${STEPS:-450}
K=${K:-4}
mkdir -p "$X"
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
run_dir() { echo "runs/smollm2-early-exit-$1-s$STEPS"; }
if want features && [ ! -d runs/smollm2-early-exit-features ]; then
  echo "== features $(date +%T)"
  torchrun --nproc_per_node 2 scripts/generate_features.py --config "$R" > "$X/features.log" 2>&1 \
    || echo "FAILED: features (see $X/features.log)"
fi
for e in $SWEEP; do
  want "train-$e" || continue
  echo "== train E=$e $(date +%T)"
  /usr/bin/time -v torchrun --nproc_per_node 2 scripts/train_eagle3.py --config "$R" --draft.exit_layer="$e" \
    --train.max_steps="$STEPS" --output_dir "$(run_dir "$e")" --logging.progress=false \
    > "$X/train-$e-s$STEPS.time" 2>&1 || echo "FAILED: train E=$e (see $X/train-$e-s$STEPS.time)"
done
for e in $SWEEP; do
  want "pair-$e" || continue
  [ -d "$(run_dir "$e")/final" ] || { echo "no adapter for E=$e: train it first"; continue; }
  echo "== E=$e k=$K $(date +%T)"
  python scripts/benchmark.py --target "$T" --questions configs/demo/eval/mt_bench.jsonl --per-category 1 \
    --max-new-tokens 128 --no-hf-reference --verify-greedy --method early-exit --draft "$(run_dir "$e")/final" \
    --num-speculative-tokens "$K" --versus "--method eagle3 --draft configs/smollm2/eagle3-head --num-speculative-tokens $K" \
    --out "$X/e$e-s$STEPS-k$K" > "$X/e$e-s$STEPS-k$K.log" 2>&1 || echo "FAILED or not greedy-exact: E=$e (see $X/e$e-s$STEPS-k$K.log)"
  grep "Paired" "$X/e$e-s$STEPS-k$K.log"
done
if want publish && [ -n "${BEST:-}" ]; then
  rm -rf configs/smollm2/early-exit-head
  python scripts/publish_head.py --run "$(run_dir "$BEST")" --out configs/smollm2/early-exit-head --recipe "$R"
fi
if want collect; then
  train=() bench=()
  for t in "$X"/train-*-s*.time; do  # every adapter trained, decoded or not
    name=$(basename "$t" .time); name=${name#train-}; e=${name%%-*}; s=${name#*-s}
    [ -f "runs/smollm2-early-exit-$e-s$s/metrics.jsonl" ] && train+=(--train "e$e-s$s=runs/smollm2-early-exit-$e-s$s:$t")
  done
  for d in "$X"/e*-k*/; do [ -f "$d/results.json" ] && bench+=(--bench "$(basename "$d")=$d"); done
  python benchmarks/heads_side_by_side.py --title "Early-exit self-speculation on SmolLM2-135M-Instruct: a sweep of the exit layer" \
    --what "SmolLM2-135M-Instruct (30 layers): an adapter (one zero-initialised residual block) on the hidden state after the first E layers, then the target's own final norm and lm_head, drafting with those E layers on the target's KV cache; trained by configs/smollm2/early_exit.yaml (SmolLM2's own replies to 1,000 demo questions from one feature store, global batch 8 = 4 x 2 CPU ranks, Muon lr 3e-3, linear decay; the step count is in each row's name: sN) for E in {$SWEEP}; each decoded paired with configs/smollm2/eagle3-head (450 steps of the same data) in one process (--versus), chains, MT-bench first question per category (16 turns), 128 tokens, greedy-exact" \
    "${train[@]}" "${bench[@]}" --out benchmarks/results/early_exit_smollm2.json
fi
