#!/usr/bin/env bash
# EAGLE-3.1, P-EAGLE and DFlash at a target's EAGLE-3 head's budget: its recipe with each head's options, each trained
# alone under GNU time and published; then each decoded paired with the target's committed EAGLE-3 head in one process
# (--versus): MT-bench's first question per category, every turn, 128 new tokens, greedy-exact, chains.
#   demo:    configs/demo/eagle3_regenerated.yaml (the target's own replies to 2,000 demo questions, 1000 steps, global
#            batch 8 in one CPU process, Muon lr 3e-3, linear decay) -> configs/demo/{eagle31,peagle,dflash}_regenerated.yaml,
#            published as configs/demo/{eagle31,peagle,dflash}-head (EAGLE-3.1 in the speculators layout).
#            Needs runs/demo-regenerated/regenerated.jsonl (the command is in eagle3_regenerated.yaml's header).
#   smollm2: configs/smollm2/eagle3.yaml (SmolLM2's replies to 1,000 demo questions from its feature store, 450 steps,
#            global batch 8 = 4 x 2 ranks, Muon lr 3e-3, linear decay) -> configs/smollm2/{eagle31,peagle,dflash}.yaml,
#            published under the run directory. Needs the feature store (its command is in eagle3.yaml's header).
#   benchmarks/bench_new_heads_full.sh [demo|smollm2]   ONLY="train-peagle peagle-k4 collect" runs just those steps
# demo: ~20 min per head to train, ~25 min of decoding; smollm2: ~40 min per head, ~40 min of decoding (2-core CPU).
# Nothing else may run meanwhile.
set -u
WHICH=${1:-demo}
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
case $WHICH in
  demo) X=runs/new-heads-full; T=configs/demo/target; H=configs/demo; NAME="the demo target"
        recipe() { echo "configs/demo/$1_regenerated.yaml"; }; run_dir() { echo "runs/demo-$1-regenerated"; }
        head_dir() { echo "configs/demo/$1-head"; }
        TRAIN=(python scripts/train_eagle3.py); TRAIN_FLAGS=(--train.batch_size=8)
        E3_COMMAND="python scripts/train_eagle3.py --config configs/demo/eagle3_regenerated.yaml --train.batch_size=8"
        DATA="the target's own replies to 2,000 demo questions, 1000 steps, global batch 8 in one CPU process" ;;
  smollm2) X=runs/new-heads-smollm2; T=targets/SmolLM2-135M-Instruct; H=configs/smollm2; NAME="SmolLM2-135M-Instruct"
        recipe() { echo "configs/smollm2/$1.yaml"; }; run_dir() { echo "runs/smollm2-$1"; }
        head_dir() { echo "$X/$1-head"; }
        TRAIN=(torchrun --nproc_per_node 2 scripts/train_eagle3.py); TRAIN_FLAGS=()
        E3_COMMAND="torchrun --nproc_per_node 2 scripts/train_eagle3.py --config configs/smollm2/eagle3.yaml"
        DATA="SmolLM2's own replies to 1,000 demo questions from one feature store, 450 steps, global batch 8 = 4 x 2 CPU ranks" ;;
  *) echo "bench_new_heads_full.sh: expected demo or smollm2, got $WHICH" >&2; exit 2 ;;
esac
mkdir -p "$X"
train() {  # NAME: trains the recipe into its run directory, GNU time log in $X
  want "train-$1" || return 0
  echo "== train $1 $(date +%T)"
  /usr/bin/time -v "${TRAIN[@]}" --config "$(recipe "$1")" "${TRAIN_FLAGS[@]}" --logging.progress=false \
    > "$X/$1.time" 2>&1 || echo "FAILED: train $1 (see $X/$1.time)"
}
publish() {  # NAME
  want "publish-$1" || return 0
  local out; out=$(head_dir "$1")
  rm -rf "$out"
  if [ "$1" = eagle31 ]; then  # the speculators layout, which carries EAGLE-3.1's norms by name
    python scripts/publish_head.py --run "$(run_dir "$1")" --out "$X/$1-published" --recipe "$(recipe "$1")" &&
    python scripts/export_head.py --head "$X/$1-published" --to speculators --out "$out" &&
    cp "$X/$1-published/README.md" "$X/$1-published/eval_metrics.json" "$out/"
    # the card describes the flat export it was published as: say which layout the directory holds
    sed -i "s/^Flat EAGLE-3 server layout ([^)]*)\./vLLM's speculators layout (\`vllm serve\` detects it; the config names the target and carries EAGLE-3.1's \`fc_norm\` and \`norm_output\`), converted losslessly from the flat export with \`scripts\/export_head.py --to speculators\`./" "$out/README.md"
  else
    python scripts/publish_head.py --run "$(run_dir "$1")" --out "$out" --recipe "$(recipe "$1")"
  fi
}
pair() {  # NAME FLAGS...: the new head first, the committed EAGLE-3 head second, at the same k
  local name=$1; shift
  want "$name" || return 0
  echo "== $name $(date +%T)"
  python scripts/benchmark.py --target "$T" --questions configs/demo/eval/mt_bench.jsonl \
    --per-category 1 --max-new-tokens 128 --no-hf-reference --verify-greedy "$@" --out "$X/$name" \
    > "$X/$name.log" 2>&1 || echo "FAILED or not greedy-exact: $name (see $X/$name.log)"
  grep "Paired" "$X/$name.log"
}
versus() { echo "--method eagle3 --draft $H/eagle3-head --num-speculative-tokens $1"; }
for h in eagle31 peagle dflash; do train $h; publish $h; done
pair eagle31-k4 --method eagle3 --draft "$(head_dir eagle31)" --num-speculative-tokens 4 --versus "$(versus 4)"
for k in 3 4 6; do
  pair "peagle-k$k" --method peagle --draft "$(head_dir peagle)" --num-speculative-tokens $k --versus "$(versus $k)"
done
for k in 4 7; do
  pair "dflash-k$k" --method dflash --draft "$(head_dir dflash)" --num-speculative-tokens $k --versus "$(versus $k)"
done
if want collect; then
  runs=()
  for d in "$X"/*-k*/; do [ -f "$d/results.json" ] && runs+=(--bench "$(basename "$d")=$d"); done
  python benchmarks/heads_side_by_side.py --title "EAGLE-3.1, P-EAGLE and DFlash at the committed EAGLE-3 head's budget" \
    --what "$NAME: the committed EAGLE-3 head $H/eagle3-head and EAGLE-3.1, P-EAGLE and DFlash heads trained by one recipe ($DATA, Muon lr 3e-3, linear decay) with each head's options; each new head decoded paired with the EAGLE-3 head in one process (--versus), chains, MT-bench first question per category (16 turns), 128 tokens, greedy-exact. EAGLE-3 was not retrained here: its row is its card's last evaluation" \
    --train "eagle3=$H/eagle3-head" --train-command "eagle3=$E3_COMMAND" \
    --train "eagle31=$(run_dir eagle31):$X/eagle31.time" --train "peagle=$(run_dir peagle):$X/peagle.time" \
    --train "dflash=$(run_dir dflash):$X/dflash.time" "${runs[@]}" --out "benchmarks/results/new_heads_$WHICH.json"
fi
