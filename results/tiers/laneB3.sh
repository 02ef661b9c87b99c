#!/bin/bash
# lane B3 at 9983f46, snapshot /work/snap-13e: the rest of lane B (CNN cell, FedDF rows of the CNN/ViT cells)
cd /work/snap-13e
export PYTHON=/work/main/.venv/bin/python
source <(sed -n '/^cell() {/,/^}/p' simulations/bench/tiers.sh)
OUT=/work/main/results/tiers
export OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
PY="nice -n 10 $PYTHON -m simulations.runners.sweep --engine inprocess --partitions dirichlet --seeds 0,1,2"
eval "$(grep -E '^(COMMON|CNN|VIT)=' simulations/bench/tiers.sh)"
{
  cell mnist1d-cnn-a0.1-t1-0125   mnist1d 0.1 "1,0.125"    "$CNN" 4
  cell mnist1d-cnn-a0.1-t1-05-025 mnist1d 0.1 "1,0.5,0.25" "$CNN" 0 feddf
  cell digits-cnn-a0.1-t1-05-025  digits  0.1 "1,0.5,0.25" "$CNN" 0 feddf
  cell digits-vit-a0.1-t1-05-025  digits  0.1 "1,0.5,0.25" "$VIT" 0 feddf
  cell mnist1d-cnn-a0.5-t1-05-025 mnist1d 0.5 "1,0.5,0.25" "$CNN" 0 feddf
  cell mnist1d-cnn-a0.1-t1-0125   mnist1d 0.1 "1,0.125"    "$CNN" 0 feddf
  echo "$(date +%T) lane B3 finished"
} >> $OUT/queue-B3.log 2>&1
