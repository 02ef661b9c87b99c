#!/bin/bash
# lane B, restarted at 1st one-shot fixes (guard off, OD off in one-shot), snapshot /work/snap-13d
cd /work/snap-13d
export PYTHON=/work/main/.venv/bin/python
source <(sed -n '/^cell() {/,/^}/p;/^oneshot() {/,/^}/p' simulations/bench/tiers.sh)
OUT=/work/main/results/tiers
export OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
PY="nice -n 10 $PYTHON -m simulations.runners.sweep --engine inprocess --partitions dirichlet --seeds 0,1,2"
eval "$(grep -E '^(COMMON|MLP|CNN|VIT|MLP1|CNN1)=' simulations/bench/tiers.sh)"
{
  oneshot oneshot-mnist1d-mlp-a0.5 mnist1d 0.5 "$MLP1"
  oneshot oneshot-digits-mlp-a0.5  digits  0.5 "$MLP1"
  oneshot oneshot-digits-cnn-a0.5  digits  0.5 "$CNN1"
  oneshot oneshot-mnist1d-cnn-a0.5 mnist1d 0.5 "$CNN1"
  oneshot oneshot-digits-vit-a0.5  digits  0.5 "$VIT"
  cell mnist1d-cnn-a0.5-t1-05-025 mnist1d 0.5 "1,0.5,0.25" "$CNN" 8
  cell mnist1d-cnn-a0.1-t1-0125   mnist1d 0.1 "1,0.125"    "$CNN" 4
  cell mnist1d-cnn-a0.1-t1-05-025 mnist1d 0.1 "1,0.5,0.25" "$CNN" 0 feddf
  cell digits-cnn-a0.1-t1-05-025  digits  0.1 "1,0.5,0.25" "$CNN" 0 feddf
  cell digits-vit-a0.1-t1-05-025  digits  0.1 "1,0.5,0.25" "$VIT" 0 feddf
  cell mnist1d-cnn-a0.5-t1-05-025 mnist1d 0.5 "1,0.5,0.25" "$CNN" 0 feddf
  cell mnist1d-cnn-a0.1-t1-0125   mnist1d 0.1 "1,0.125"    "$CNN" 0 feddf
  oneshot oneshot-mnist1d-mlp-a0.1 mnist1d 0.1 "$MLP1"
  oneshot oneshot-digits-mlp-a0.1  digits  0.1 "$MLP1"
  echo "$(date +%T) lane B2 finished"
} >> $OUT/queue-B2.log 2>&1
