#!/bin/bash
# One-shot benchmark rows for ot / rebasin / transfusion (issue #4), CPU-size settings (each
# invocation of simulations.one_shot finishes in ≤ ~20 min on a shared 2-core machine).
# Run from the repo root:
#   bash simulations/ot_one_shot.sh                 # all jobs below, one after the other
#   JOBS="cnn resnet" bash simulations/ot_one_shot.sh
#   SEEDS=0 bash simulations/ot_one_shot.sh         # quick check
# Jobs: cnn, resnet (digits + mnist1d × shards2 + dirichlet4), vit_mnist1d (mnist1d/shards2),
#       mlp_hetero (width-heterogeneous mnist1d MLP), transport (mnist1d task-vector transport, seeds 1-2),
#       timing (fusion-time table). Outputs in results/ot/ (git-ignored); clients cached in results/cache/.
set -e
export OMP_WAIT_POLICY=PASSIVE
PY=${PY:-.venv/bin/python}
OUT=${OUT:-results/ot}
SEEDS=${SEEDS:-0,1,2}
REF='average,ensemble,kd,kf-linear,kf-gradient'
OT='ot,ot[solver="sinkhorn"],rebasin,ot[finetune=10]'
for job in ${JOBS:-cnn resnet vit_mnist1d mlp_hetero transport timing}; do
  case $job in
    cnn|resnet)
      $PY -m simulations.one_shot --datasets digits,mnist1d --partitions shards2,dirichlet4 --models $job \
        --epochs 15 --methods "$OT,$REF" --importance uniform --seeds $SEEDS --threads 1 \
        --out $OUT/one_shot_$job --title "One-shot fusion, $job (width 16, 15 epochs max): OT / re-basin" ;;
    vit_mnist1d)
      $PY -m simulations.one_shot --datasets mnist1d --partitions shards2 --models vit \
        --epochs 20 --methods "$OT,transfusion,$REF" --importance uniform --seeds $SEEDS --threads 1 \
        --out $OUT/one_shot_vit_mnist1d --title "One-shot fusion, vit (width 32, depth 2, 20 epochs max): OT / re-basin / TransFusion" ;;
    mlp_hetero)
      $PY -m simulations.ot_benchmark hetero --datasets mnist1d --partitions shards2,dirichlet4 --models mlp \
        --seeds $SEEDS --out $OUT --tag mnist1d ;;
    transport)
      $PY -m simulations.ot_benchmark transport --datasets mnist1d --seeds ${TRANSPORT_SEEDS:-1,2} --out $OUT \
        --tag mnist1d_s$(echo ${TRANSPORT_SEEDS:-1,2} | tr -d ,) ;;
    timing)
      $PY -m simulations.ot_benchmark timing --out $OUT ;;
    *) echo "unknown job $job" >&2; exit 2 ;;
  esac
done
