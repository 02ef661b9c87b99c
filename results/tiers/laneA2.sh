#!/bin/bash
# lane A2 at 9983f46, snapshot /work/snap-13e: seeds 3 and 4 of the MNIST-1D MLP cells (the goal cells), every row
cd /work/snap-13e
export PYTHON=/work/main/.venv/bin/python
source <(sed -n '/^cell() {/,/^}/p' simulations/bench/tiers.sh)
OUT=/work/main/results/tiers
export OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
PY="nice -n 10 $PYTHON -m simulations.runners.sweep --engine inprocess --partitions dirichlet --seeds 3,4"
eval "$(grep -E '^(COMMON|MLP)=' simulations/bench/tiers.sh)"
{
  for x in "" feddf; do
    cell mnist1d-mlp-a0.1-t1-05-025 mnist1d 0.1 "1,0.5,0.25" "$MLP" 64 $x
    cell mnist1d-mlp-a0.1-t1-0125   mnist1d 0.1 "1,0.125"    "$MLP" 32 $x
    cell mnist1d-mlp-a0.5-t1-05-025 mnist1d 0.5 "1,0.5,0.25" "$MLP" 64 $x
    cell mnist1d-mlp-a0.5-t1-0125   mnist1d 0.5 "1,0.125"    "$MLP" 32 $x
  done
  echo "$(date +%T) lane A2 finished"
} >> $OUT/queue-A2.log 2>&1
