#!/usr/bin/env bash
# Ordered dropout's width draw (issue 26, the width-tier cells the default loses):
# `average` with ordered-dropout-draw (width, or the own width's probability 0.75 / 0.9) next to the committed rows of results/tiers/<cell> (same run
# configs and seeds; the default row reruns bit-identically, so the committed baselines compare as they stand).
#   bash simulations/bench/od_draw.sh OUT CELL...     (CELL as in results/tiers/, e.g. mnist1d-mlp-a0.1-t1-0125)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=$(realpath -m "$1"); shift
mkdir -p "$OUT"
export OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
PY=${PYTHON:-.venv/bin/python}
ROWS=${ROWS:-"average[ordered-dropout-draw='width']"}
for name in "$@"; do
  # the cell's run config and seeds, as committed (results/tiers/<cell>/table.md's first line)
  line=$(head -1 "results/tiers/$name/table.md")
  cfg=$(echo "$line" | sed -E 's/^Run config: `(.*)`; seeds \[(.*)\]$/\1/')
  seeds=$(echo "$line" | sed -E 's/^Run config: `(.*)`; seeds \[(.*)\]$/\2/' | tr -d ' ')
  echo "$(date +%T) $name seeds $seeds"
  $PY -m fedfuse.flower.runner.sweep --engine inprocess --partitions dirichlet --seeds "$seeds" --strategies "$ROWS" \
    --run-config "$cfg" --out "$OUT/$name" > "$OUT/$name.log" 2>&1
done
