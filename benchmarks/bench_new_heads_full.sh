#!/usr/bin/env bash
# EAGLE-3.1, P-EAGLE and DFlash at the committed EAGLE-3 head's budget on the demo target: its recipe
# (configs/demo/eagle3_regenerated.yaml: the target's own replies to 2,000 demo questions, 1000 steps, global batch 8
# in one CPU process, Muon lr 3e-3, linear decay) with each head's options (configs/demo/{eagle31,peagle,dflash}_
# regenerated.yaml), each trained alone under GNU time; published as configs/demo/{eagle31,peagle,dflash}-head
# (EAGLE-3.1 in the speculators layout); then each decoded paired with configs/demo/eagle3-head in one process
# (--versus): MT-bench's first question per category, every turn, 128 new tokens, greedy-exact, chains.
# Needs runs/demo-regenerated/regenerated.jsonl (the command is in eagle3_regenerated.yaml's header).
#   benchmarks/bench_new_heads_full.sh            ONLY="train-peagle peagle-k4 collect" runs just those steps
# ~20 min per head to train and ~25 min of decoding on a 2-core CPU; nothing else may run meanwhile.
set -u
X=runs/new-heads-full
mkdir -p "$X"
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
train() {  # NAME: trains configs/demo/NAME_regenerated.yaml into runs/demo-NAME-regenerated, GNU time log in $X
  want "train-$1" || return 0
  echo "== train $1 $(date +%T)"
  /usr/bin/time -v python scripts/train_eagle3.py --config "configs/demo/$1_regenerated.yaml" --train.batch_size=8 \
    --logging.progress=false > "$X/$1.time" 2>&1 || echo "FAILED: train $1 (see $X/$1.time)"
}
publish() {  # NAME
  want "publish-$1" || return 0
  rm -rf "configs/demo/$1-head"
  if [ "$1" = eagle31 ]; then  # the speculators layout, which carries EAGLE-3.1's norms by name
    python scripts/publish_head.py --run "runs/demo-$1-regenerated" --out "$X/$1-published" \
      --recipe "configs/demo/$1_regenerated.yaml" &&
    python scripts/export_head.py --head "$X/$1-published" --to speculators --out "configs/demo/$1-head" &&
    cp "$X/$1-published/README.md" "$X/$1-published/eval_metrics.json" "configs/demo/$1-head/"
    # the card describes the flat export it was published as: say which layout the directory holds
    sed -i "s/^Flat EAGLE-3 server layout ([^)]*)\./vLLM's speculators layout (\`vllm serve\` detects it; the config names the target and carries EAGLE-3.1's \`fc_norm\` and \`norm_output\`), converted losslessly from the flat export with \`scripts\/export_head.py --to speculators\`./" "configs/demo/$1-head/README.md"
  else
    python scripts/publish_head.py --run "runs/demo-$1-regenerated" --out "configs/demo/$1-head" \
      --recipe "configs/demo/$1_regenerated.yaml"
  fi
}
pair() {  # NAME FLAGS...: the new head first, the committed EAGLE-3 head second, at the same k
  local name=$1; shift
  want "$name" || return 0
  echo "== $name $(date +%T)"
  python scripts/benchmark.py --target configs/demo/target --questions configs/demo/eval/mt_bench.jsonl \
    --per-category 1 --max-new-tokens 128 --no-hf-reference --verify-greedy "$@" --out "$X/$name" \
    > "$X/$name.log" 2>&1 || echo "FAILED or not greedy-exact: $name (see $X/$name.log)"
  grep "Paired" "$X/$name.log"
}
versus() { echo "--method eagle3 --draft configs/demo/eagle3-head --num-speculative-tokens $1"; }
for h in eagle31 peagle dflash; do train $h; publish $h; done
pair eagle31-k4 --method eagle3 --draft configs/demo/eagle31-head --num-speculative-tokens 4 --versus "$(versus 4)"
for k in 3 4 6; do
  pair "peagle-k$k" --method peagle --draft configs/demo/peagle-head --num-speculative-tokens $k --versus "$(versus $k)"
done
for k in 4 7; do
  pair "dflash-k$k" --method dflash --draft configs/demo/dflash-head --num-speculative-tokens $k --versus "$(versus $k)"
done
if want collect; then
  runs=()
  for d in "$X"/*-k*/; do [ -f "$d/results.json" ] && runs+=(--bench "$(basename "$d")=$d"); done
  python benchmarks/heads_side_by_side.py --title "EAGLE-3.1, P-EAGLE and DFlash at the committed EAGLE-3 head's budget" \
    --what "The committed demo heads configs/demo/{eagle3,eagle31,peagle,dflash}-head: one recipe (the target's own replies to 2,000 demo questions, 1000 steps, global batch 8 in one CPU process, Muon lr 3e-3, linear decay) with each head's options; each new head decoded paired with the EAGLE-3 head in one process (--versus), chains, MT-bench first question per category (16 turns), 128 tokens, greedy-exact. EAGLE-3 was not retrained here: its row is its card's last evaluation" \
    --train eagle3=configs/demo/eagle3-head \
    --train-command "eagle3=python scripts/train_eagle3.py --config configs/demo/eagle3_regenerated.yaml --train.batch_size=8" \
    --train "eagle31=runs/demo-eagle31-regenerated:$X/eagle31.time" --train "peagle=runs/demo-peagle-regenerated:$X/peagle.time" \
    --train "dflash=runs/demo-dflash-regenerated:$X/dflash.time" "${runs[@]}" --out benchmarks/results/new_heads_demo.json
fi
