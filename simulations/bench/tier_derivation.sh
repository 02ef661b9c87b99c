#!/usr/bin/env bash
# Tier derivation cost (issue 26): the pruning-vs-ranking microbenchmark, then the default (`average`) rerun on every
# MNIST-1D capacity-tier cell of results/tiers/ (same run configs, seeds 0,1,2) for the per-round derivation and
# aggregation per widest-tier local epoch; run alone on the machine (it times).
#   bash simulations/bench/tier_derivation.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=$(realpath -m "${1:-results/tier-derivation}")
mkdir -p "$OUT/sweeps"
export OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
PY=${PYTHON:-.venv/bin/python}
$PY -m simulations.bench.tier_derivation --out "$OUT"
COMMON="local-epochs=1 num-clients=10 num-server-rounds=30 batch-size=32 min-train-nodes=5 fusion-set-size=300"
MLP="model='mlp' optimizer='sgd' lr=0.2 model-width=256 model-depth=2"
CNN="model='cnn' optimizer='sgd' lr=0.2 model-width=32 model-depth=2"
for spec in "mlp 0.1 1,0.125" "mlp 0.1 1,0.5,0.25" "mlp 0.5 1,0.125" "mlp 0.5 1,0.5,0.25" \
            "cnn 0.1 1,0.125" "cnn 0.1 1,0.5,0.25" "cnn 0.5 1,0.5,0.25"; do
  read -r fam a tiers <<< "$spec"
  model=$MLP; [ "$fam" = cnn ] && model=$CNN
  name="mnist1d-$fam-a$a-t$(echo "$tiers" | tr ',' '-' | tr -d '.')"
  echo "$(date +%T) $name"
  $PY -m fedfuse.flower.runner.sweep --engine inprocess --partitions dirichlet --seeds 0,1,2 --strategies average \
    --run-config "dataset='mnist1d' dirichlet-alpha=$a $COMMON $model client-tiers='$tiers'" \
    --out "$OUT/sweeps/$name" > "$OUT/sweeps/$name.log" 2>&1
done
$PY -m simulations.bench.tier_derivation --sweeps results/tiers "$OUT/sweeps" | tee "$OUT/sweeps.md"
