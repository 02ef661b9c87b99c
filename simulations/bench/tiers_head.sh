#!/usr/bin/env bash
# The head round with width tiers (issue 26, the width-tier cells): every multi-round cell of results/tiers/ rerun
# with the current defaults (head-round=true now solves every tier's classifier), the default `average` and every
# baseline getting it: HeteroFL, FedRolex, FedAvg at the smallest width, FedAvg of the full-width clients (lane A),
# FedDF (lane B, the slowest rows; the two lanes can run side by side on 2 cores). Same run configs and seeds as
# the committed cells (results/tiers/<cell>/table.md's first line).
#   bash simulations/bench/tiers_head.sh A|B OUT [CELL...]
#   ROWS="average[ordered-dropout='off'],..." bash simulations/bench/tiers_head.sh C OUT [CELL...]   (variants)
#   ROWS="feddf[lr=0.05],feddf[lr=0.1]" bash simulations/bench/tiers_head.sh G OUT CELL...   (FedDF at other lrs: the
#   table reads each baseline at its best lr; the SGD cells, as the lrs are SGD's)
# then: .venv/bin/python -m simulations.bench.tiers_head OUT
set -euo pipefail
cd "$(dirname "$0")/../.."
LANE=$1; OUT=$(realpath -m "$2"); shift 2
CELLS=("$@")
if [ ${#CELLS[@]} -eq 0 ]; then
  # the ViT cell first (the one the default lost), then the rest
  CELLS=(digits-vit-a0.1-t1-05-025 $(ls results/tiers | grep -E '^(digits|mnist1d)-(mlp|cnn)-a0\.[15]-t1-' | sort))
fi
export OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
mkdir -p "$OUT/$LANE"
PY=${PYTHON:-.venv/bin/python}
for name in "${CELLS[@]}"; do
  line=$(head -1 "results/tiers/$name/table.md")
  cfg=$(echo "$line" | sed -E 's/^Run config: `(.*)`; seeds \[(.*)\]$/\1/')
  seeds=$(echo "$line" | sed -E 's/^Run config: `(.*)`; seeds \[(.*)\]$/\2/' | tr -d ' ')
  if [ -n "${ROWS:-}" ]; then   # other rows (lane C: variants of the default), e.g. ROWS="average[ordered-dropout='off']"
    rows=$ROWS
  elif [ "$LANE" = B ]; then
    rows=feddf
  else   # the committed cell's FedAvg rows, as they were run
    fedavg=$($PY -c "import json,sys; print(','.join(dict.fromkeys(r['strategy'] for r in json.load(open(sys.argv[1])) if r['strategy'].startswith('fedavg['))))" "results/tiers/$name/sweep.json")
    rows="average,heterofl,fedrolex,$fedavg"
  fi
  echo "$(date +%T) $name lane $LANE seeds $seeds"
  $PY -m fedfuse.flower.runner.sweep --engine inprocess --partitions dirichlet --seeds "$seeds" --strategies "$rows" \
    --run-config "$cfg" --out "$OUT/$LANE/$name" > "$OUT/$LANE/$name.log" 2>&1 || echo "FAILED $name lane $LANE"
done
echo "$(date +%T) lane $LANE done"
