#!/usr/bin/env bash
# The width-tier cells of results/tiers-head rerun with one run-config override on every row (the head round's
# head-solver, issue 26): lane A the default, HeteroFL, FedRolex and the cell's FedAvg rows; lane B FedDF at its best
# lr in results/tiers-head (read from lanes B and G there). Same run configs and seeds as results/tiers/<cell>.
#   bash simulations/bench/tiers_head_solver.sh A|B OUT ["head-solver='best'"]
# then: .venv/bin/python -m simulations.bench.tiers_head OUT --strip "head-solver='best'"
set -euo pipefail
cd "$(dirname "$0")/../.."
LANE=$1; OUT=$(realpath -m "$2"); OVERRIDE=${3:-"head-solver='best'"}
export OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT/$LANE"
ROWS=$($PY - "$OVERRIDE" <<'PYEOF'
import json, sys
from pathlib import Path
from simulations.bench.tiers_head import _new_rows, best_lr
override = sys.argv[1]
add = lambda label: label[:-1] + f" {override}]" if label.endswith("]") else label + f"[{override}]"
for cell in sorted(p.parent.name for p in Path("results/tiers-head/A").glob("*/sweep.json")):
    runs = json.loads(Path(f"results/tiers/{cell}/sweep.json").read_text())
    fedavg = list(dict.fromkeys(r["strategy"] for r in runs if r["strategy"].startswith("fedavg[")))
    feddf = best_lr(_new_rows(Path("results/tiers-head"), cell, best=False), "feddf") or "feddf"
    print(cell, "|", ",".join(add(x) for x in ["average", "heterofl", "fedrolex", *fedavg]), "|", add(feddf))
PYEOF
)
while IFS='|' read -r name rowsA rowB; do
  name=$(echo $name); rowsA=$(echo $rowsA); rowB=$(echo $rowB)
  line=$(head -1 "results/tiers/$name/table.md")
  cfg=$(echo "$line" | sed -E 's/^Run config: `(.*)`; seeds \[(.*)\]$/\1/')
  seeds=$(echo "$line" | sed -E 's/^Run config: `(.*)`; seeds \[(.*)\]$/\2/' | tr -d ' ')
  rows=$rowsA; [ "$LANE" = B ] && rows=$rowB
  echo "$(date +%T) $name lane $LANE"
  $PY -m fedfuse.flower.runner.sweep --engine inprocess --partitions dirichlet --seeds "$seeds" --strategies "$rows" \
    --run-config "$cfg" --out "$OUT/$LANE/$name" > "$OUT/$LANE/$name.log" 2>&1 || echo "FAILED $name lane $LANE"
done <<< "$ROWS"
echo "$(date +%T) lane $LANE done"
