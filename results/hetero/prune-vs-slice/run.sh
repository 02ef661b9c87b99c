#!/bin/bash
# tier-models='prune' vs 'slice' (issues 13/14), from the snapshot worktree /work/snap-14d (commit a328863)
set -u
source /work/main/results/hetero/cfg.sh
export OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1
PY="nice -n 19 /work/main/.venv/bin/python -m simulations.runners.sweep --engine inprocess --partitions dirichlet"
O=/work/main/results/hetero/prune-vs-slice
cd /work/snap-14d
if [ "$1" = A ]; then
  $PY --seeds 0 --strategies "average[tier-models='prune'],average[tier-models='slice'],kf-linear[tier-models='prune'],kf-linear[tier-models='slice']" --run-config "$CFG" --out $O/s0 > $O/s0.log 2>&1
fi
if [ "$1" = B ]; then
  $PY --seeds 1,2 --strategies "average[tier-models='prune'],average[tier-models='slice']" --run-config "$CFG" --out $O/s12 > $O/s12.log 2>&1
fi
if [ "$1" = C ]; then
  $PY --seeds 1,2 --strategies "kf-linear[tier-models='prune'],kf-linear[tier-models='slice']" --run-config "$CFG" --out $O/kf12 > $O/kf12.log 2>&1
fi
if [ "$1" = D ]; then
  $PY --seeds 0,1,2 --strategies "heterofl,average[tier-models='prune-recover']" --run-config "$CFG" --out $O/rec > $O/rec.log 2>&1
fi
