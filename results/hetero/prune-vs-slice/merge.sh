#!/bin/bash
# all rows of run.sh's lanes in one table (sweep --tables-only over the merged sweep.json)
set -u
source /work/main/results/hetero/cfg.sh
O=/work/main/results/hetero/prune-vs-slice
mkdir -p $O/all
/work/main/.venv/bin/python - <<PY
import json, pathlib
o = pathlib.Path("$O")
rows = []
for d in ("s0", "s12", "kf12", "rec"):
    p = o / d / "sweep.json"
    if p.exists():
        rows += json.loads(p.read_text())
(o / "all" / "sweep.json").write_text(json.dumps(rows, indent=1))
PY
cd /work/snap-14d && /work/main/.venv/bin/python -m simulations.runners.sweep --tables-only --engine inprocess --partitions dirichlet --seeds 0,1,2 \
  --strategies "heterofl,average[tier-models='slice'],average[tier-models='prune'],average[tier-models='prune-recover'],kf-linear[tier-models='slice'],kf-linear[tier-models='prune']" \
  --timing-reference heterofl --run-config "$CFG" --out $O/all
