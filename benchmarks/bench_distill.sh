#!/usr/bin/env bash
# Distilled draft models against the committed one (configs/demo/draft-model: 2 layers of the demo target's width,
# trained 400 steps on the data's tokens), on the demo target. Each variant is configs/demo/distill.yaml (the same size
# and 400 steps; the target's own replies to 2,000 demo questions from one feature store, 32 conversations a step)
# with one change, trained under GNU time; the recipe's own run (TV) is published as configs/demo/distilled-draft-model.
# Forward KL is the base of the data, init, filter and fixed-data variants (as the table in BENCHMARKS.md was run).
# Then each is decoded paired with the committed draft model in one process (--versus): MT-bench's first question
# per category, every turn, 128 new tokens, greedy-exact, chains of 4.
# Needs runs/demo-regenerated/regenerated.jsonl (the command is in configs/demo/eagle3_regenerated.yaml's header).
#   benchmarks/bench_distill.sh            ONLY="train-rkl rkl collect" runs just those steps
#   JOBS=2 benchmarks/bench_distill.sh     trains two variants at a time, one thread each (tau does not depend on it;
#                                          the training table's wall times then include the sharing, CPU times do not)
# ~22 min per variant to train and ~1 min to decode on a 2-core CPU; decoding must run with nothing else.
set -u
X=runs/distill
mkdir -p "$X"
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
FKL=--draft.loss=kl
declare -A CHANGE=(
  [tv]=""                                   # the recipe: total variation (DistillSpec's TVD), init from the target
  [fkl]="$FKL"                              # forward KL (DistillSpec's FKL)
  [rkl]="--draft.loss=rkl"                  # reverse KL
  [data]="$FKL --draft.labels=data"         # cross-entropy to the data's tokens: no distillation, same data and steps
  [fresh]="$FKL --draft.init=fresh"         # random initialisation instead of the target's first layers
  [adaspec]="$FKL --draft.filter_reference=runs/demo-distill-fkl/final --draft.filter_keep=0.4"  # AdaSPEC: FKL's as reference
  [tv-fresh]="--draft.init=fresh"           # TV with the init and the filter that helped forward KL
  [tv-adaspec]="--draft.filter_reference=runs/demo-distill-fkl/final --draft.filter_keep=0.4"
  # the fixed data: the same 2,000 questions with the data's own replies (the first 500 rows of each file, as
  # regenerated), not the target's; FKL to the target's distribution on them (their own feature store)
  [fixed]="$FKL --data.files=['configs/demo/data/gsm8k_train.jsonl[:500]','configs/demo/data/gpteacher_codegen.json[:500]','configs/demo/data/gpteacher_roleplay.json[:500]','configs/demo/data/gpteacher_toolformer.json[:500]'] --features.path=runs/demo-distill-fixed-features"
)
VARIANTS="tv fkl rkl data fresh adaspec fixed tv-fresh tv-adaspec"
run_dir() { [ "$1" = tv ] && echo runs/demo-distill || echo "runs/demo-distill-$1"; }
head_dir() { [ "$1" = tv ] && echo configs/demo/distilled-draft-model || echo "$(run_dir "$1")/final"; }  # as published
if want features && [ ! -d runs/demo-distill-features ]; then
  python scripts/generate_features.py --config configs/demo/distill.yaml > "$X/features.log" 2>&1
fi
if want features && [ ! -d runs/demo-distill-fixed-features ]; then
  # shellcheck disable=SC2086
  python scripts/generate_features.py --config configs/demo/distill.yaml ${CHANGE[fixed]} > "$X/features-fixed.log" 2>&1
fi
JOBS=${JOBS:-1}
train() {
  # shellcheck disable=SC2086
  /usr/bin/time -v python scripts/train_eagle3.py --config configs/demo/distill.yaml --output_dir "$(run_dir "$1")" \
    ${CHANGE[$1]} --logging.progress=false > "$X/$1.time" 2>&1 || echo "FAILED: train $1 (see $X/$1.time)"
}
[ "$JOBS" -gt 1 ] && export OMP_NUM_THREADS=1
for v in $VARIANTS; do
  want "train-$v" || continue
  [[ $v == *adaspec ]] && want train-fkl && wait  # its reference is the fkl run, trained first
  echo "== train $v $(date +%T)"
  if [ "$JOBS" -gt 1 ]; then
    train "$v" &
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
  else
    train "$v"
  fi
done
wait
unset OMP_NUM_THREADS
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
    if [ -f "$X/$v.time" ]; then train+=(--train "$v=$(run_dir "$v"):$X/$v.time")
    else train+=(--train "$v=$(head_dir "$v")"); fi  # published, not retrained: its times from earlier result files
    bench+=(--bench "$v=$X/$v-k4")
  done
  # a published variant's training time: from the result file's earlier versions kept in $X, named by their commit
  prev=benchmarks/results/distilled_draft_model_demo.json
  if [ -f $prev ]; then
    cp $prev "$X/$(basename $prev)@$(python -c "import json, sys; print(json.load(open(sys.argv[1]))['commit'])" $prev)"
  fi
  earlier=(); for f in "$X/$(basename $prev)"@*; do [ -f "$f" ] && earlier+=(--times-from "$f"); done
  python benchmarks/heads_side_by_side.py --title "Distilled draft models against the committed draft model" \
    --what "The demo target: draft models of the committed draft model's size (2 layers, 4.06M parameters) and step count (400), trained by configs/demo/distill.yaml (total variation; the target's own replies to 2,000 demo questions from one feature store, 32 conversations a step, AdamW 1.5e-3 cosine) with one change each, forward KL the base of the data, init, filter and fixed-data variants, and TV with the init and the filter that helped forward KL (tv-fresh, tv-adaspec; the filter's reference is the fkl head, which adaspec's command names where it was then, configs/demo/distilled-draft-model). Training commands are as run: one without --draft.loss ran while the recipe's loss was forward KL, before TV won here, so it reproduces today with --draft.loss=kl added (trained ${JOBS:-1} at a time, one thread each when more: wall times include that sharing, CPU times do not); each decoded paired with configs/demo/draft-model (400 steps of 4,096 tokens of the fixed demo data, cross-entropy) in one process (--versus), chains of 4, MT-bench first question per category (16 turns), 128 tokens, greedy-exact" \
    "${train[@]}" "${bench[@]}" "${earlier[@]}" --out benchmarks/results/distilled_draft_model_demo.json
fi
