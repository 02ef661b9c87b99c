#!/bin/bash
# Every OT-family benchmark of issue #4 (ot / rebasin / transfusion one-shot rows, width-heterogeneous
# fusion, task-vector transport, fusion time), CPU-size settings, one after the other. From the repo root:
#   bash simulations/bench/ot_suite.sh                 # all jobs
#   JOBS="cnn resnet" bash simulations/bench/ot_suite.sh
#   SEEDS=0 bash simulations/bench/ot_suite.sh         # quick check
# Outputs in $OUT (default results/ot); clients cached in results/cache.
set -euo pipefail
PY=${PY:-.venv/bin/python}
OUT=${OUT:-results/ot}
SEEDS=${SEEDS:-0,1,2}
REF='average,ensemble,kd,kf-linear,kf-gradient'
OT='ot,ot[solver="sinkhorn"],rebasin,ot[finetune=10]'
for job in ${JOBS:-cnn resnet vit_mnist1d mlp_hetero transport timing}; do
  case $job in
    cnn|resnet)
      $PY -m simulations.bench.one_shot --datasets digits,mnist1d --partitions shards2,dirichlet4 --models "$job" \
        --epochs 15 --methods "$OT,$REF" --importance uniform --seeds "$SEEDS" \
        --out "$OUT/one_shot_$job" --title "One-shot fusion, $job (width 16, 15 epochs max): OT / re-basin" ;;
    vit_mnist1d)
      $PY -m simulations.bench.one_shot --datasets mnist1d --partitions shards2 --models vit \
        --epochs 20 --methods "$OT,transfusion,$REF" --importance uniform --seeds "$SEEDS" \
        --out "$OUT/one_shot_vit_mnist1d" --title "One-shot fusion, vit (width 32, depth 2, 20 epochs max): OT / re-basin / TransFusion" ;;
    mlp_hetero)
      $PY -m simulations.bench.ot hetero --datasets mnist1d --partitions shards2,dirichlet4 --models mlp \
        --seeds "$SEEDS" --out "$OUT" --tag mnist1d ;;
    transport)
      TS=${TRANSPORT_SEEDS:-1,2}
      $PY -m simulations.bench.ot transport --datasets mnist1d --seeds "$TS" --out "$OUT" --tag "mnist1d_s${TS//,/}" ;;
    timing)
      $PY -m simulations.bench.fusion_time --dataset digits --partition dirichlet4 --model vit --seed 0 \
        --epochs 10 --lr 1e-3 --optimizer adam --weight-decay 0 --label-smoothing 0 --patience 0 --schedule constant \
        --model-options '{"vit": {"num_heads": 4}}' --importance uniform --repeats 9 --out "$OUT/timing" \
        --methods 'ot[solver="sinkhorn"],ot[solver="emd"],ot[solver="emd",cost="weights"],rebasin,rebasin[matching="weights"],transfusion' ;;
    *) echo "ot_suite.sh: unknown job '$job' (cnn, resnet, vit_mnist1d, mlp_hetero, transport, timing)" >&2; exit 2 ;;
  esac
done
