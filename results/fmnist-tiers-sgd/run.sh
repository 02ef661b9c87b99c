#!/usr/bin/env bash
# Issue 47 part 3: width tiers on Fashion-MNIST (cnn), one cell, alpha 0.5, one sweep call per seed (so that
# every finished seed is a complete set of rows). Raw run folders go to results/fmnist-tiers-sgd/runs/ (ignored).
set -uo pipefail
cd "$(dirname "$0")/../.."
export OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
CFG="dataset='fashion-mnist' model='cnn' model-width=16 model-depth=2 client-tiers='1,0.5,0.25' num-clients=6 dirichlet-alpha=0.5 num-server-rounds=2 local-epochs=1 optimizer='sgd' lr=0.05 batch-size=32 min-train-nodes=3 client-references=false"
ROWS="average,heterofl,fedrolex,fedavg[model-width=4 client-tiers='' sweep-as-tier=0.25]"
for s in ${SEEDS:-0 1 2}; do
  echo "$(date -u +%T) seed $s"
  nice -n 10 .venv/bin/python -m fedfuse.flower.runner.sweep --engine inprocess --partitions dirichlet --seeds "$s" \
    --strategies "$ROWS" --run-config "$CFG" --out "results/fmnist-tiers-sgd/runs/a0.5-s$s" > "results/fmnist-tiers-sgd/runs/a0.5-s$s.log" 2>&1 || echo "FAILED seed $s"
done
echo "$(date -u +%T) done"
