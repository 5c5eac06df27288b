#!/usr/bin/env bash
# Distilled draft models against the committed one (configs/demo/draft-model: 2 layers of the demo target's width,
# trained 400 steps on the data's tokens), on the demo target. Each variant is configs/demo/distill.yaml (the same size
# and 400 steps; the target's own replies to 2,000 demo questions from one feature store, 32 conversations a step)
# with one change, trained alone under GNU time; the forward-KL run is published as
# configs/demo/distilled-draft-model. Then each is decoded paired with the committed draft model in one process
# (--versus): MT-bench's first question per category, every turn, 128 new tokens, greedy-exact, chains of 4.
# Needs runs/demo-regenerated/regenerated.jsonl (the command is in configs/demo/eagle3_regenerated.yaml's header).
#   benchmarks/bench_distill.sh            ONLY="train-rkl rkl collect" runs just those steps
# ~22 min per variant to train and ~1 min to decode on a 2-core CPU; nothing else may run meanwhile.
set -u
X=runs/distill
mkdir -p "$X"
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
declare -A CHANGE=(
  [fkl]=""                                  # forward KL to the target (DistillSpec's FKL), init from the target
  [rkl]="--draft.loss=rkl"                  # reverse KL
  [tv]="--draft.loss=tv"                    # total variation (DistillSpec's TVD)
  [data]="--draft.labels=data"              # cross-entropy to the data's tokens: no distillation, same data and steps
  [fresh]="--draft.init=fresh"              # random initialisation instead of the target's first layers
  [adaspec]="--draft.filter_reference=runs/demo-distill/final --draft.filter_keep=0.4"  # AdaSPEC, FKL's run as reference
)
VARIANTS="fkl rkl tv data fresh adaspec"
run_dir() { [ "$1" = fkl ] && echo runs/demo-distill || echo "runs/demo-distill-$1"; }
head_dir() { [ "$1" = fkl ] && echo configs/demo/distilled-draft-model || echo "$(run_dir "$1")/final"; }  # as published
if want features && [ ! -d runs/demo-distill-features ]; then
  python scripts/generate_features.py --config configs/demo/distill.yaml > "$X/features.log" 2>&1
fi
for v in $VARIANTS; do
  want "train-$v" || continue
  echo "== train $v $(date +%T)"
  # shellcheck disable=SC2086
  /usr/bin/time -v python scripts/train_eagle3.py --config configs/demo/distill.yaml --output_dir "$(run_dir "$v")" \
    ${CHANGE[$v]} --logging.progress=false > "$X/$v.time" 2>&1 || echo "FAILED: train $v (see $X/$v.time)"
done
if want publish; then
  rm -rf configs/demo/distilled-draft-model
  python scripts/publish_head.py --run runs/demo-distill --out configs/demo/distilled-draft-model \
    --recipe configs/demo/distill.yaml
fi
for v in $VARIANTS; do
  want "$v" || continue
  [ -d "$(head_dir "$v")" ] || continue
  echo "== $v $(date +%T)"
  python scripts/benchmark.py --target configs/demo/target --questions configs/demo/eval/mt_bench.jsonl \
    --per-category 1 --max-new-tokens 128 --no-hf-reference --verify-greedy --method draft-model \
    --draft "$(head_dir "$v")" --num-speculative-tokens 4 \
    --versus "--method draft-model --draft configs/demo/draft-model --num-speculative-tokens 4" --out "$X/$v-k4" \
    > "$X/$v-k4.log" 2>&1 || echo "FAILED or not greedy-exact: $v (see $X/$v-k4.log)"
  grep "Paired" "$X/$v-k4.log"
done
if want collect; then
  train=() bench=()
  for v in $VARIANTS; do
    [ -f "$X/$v-k4/results.json" ] || continue
    train+=(--train "$v=$(run_dir "$v"):$X/$v.time"); bench+=(--bench "$v=$X/$v-k4")
  done
  python benchmarks/heads_side_by_side.py --title "Distilled draft models against the committed draft model" \
    --what "The demo target: draft models of the committed draft model's size (2 layers, 4.06M parameters) and step count (400), trained by configs/demo/distill.yaml (the target's own replies to 2,000 demo questions from one feature store, 32 conversations a step, AdamW 1.5e-3 cosine) with one change each; each decoded paired with configs/demo/draft-model (400 steps of 4,096 tokens of the fixed demo data, cross-entropy) in one process (--versus), chains of 4, MT-bench first question per category (16 turns), 128 tokens, greedy-exact" \
    "${train[@]}" "${bench[@]}" --out benchmarks/results/distilled_draft_model_demo.json
fi
