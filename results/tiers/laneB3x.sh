#!/bin/bash
# FedDF rows of the CNN / ViT cells, two lanes (X: 1st arg), snapshot /work/snap-13e (9983f46)
cd /work/snap-13e
export OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
OUT=/work/main/results/tiers
eval "$(grep -E '^(COMMON|CNN|VIT)=' simulations/bench/tiers.sh)"
f() {  # f NAME DATASET ALPHA TIERS MODEL SEEDS
  echo "$(date +%T) $1 feddf seeds $6"
  nice -n 10 /work/main/.venv/bin/python -m simulations.runners.sweep --engine inprocess --partitions dirichlet --seeds $6 \
    --strategies feddf --run-config "dataset='$2' dirichlet-alpha=$3 $COMMON $5 client-tiers='$4'" --out $OUT/$1 >> $OUT/$1.log 2>&1
}
{
if [ "$1" = a ]; then
  f mnist1d-cnn-a0.1-t1-05-025 mnist1d 0.1 "1,0.5,0.25" "$CNN" 1,2
  f digits-cnn-a0.1-t1-05-025  digits  0.1 "1,0.5,0.25" "$CNN" 0,1,2
  f digits-vit-a0.1-t1-05-025  digits  0.1 "1,0.5,0.25" "$VIT" 0,1,2
fi
if [ "$1" = b ]; then
  f mnist1d-cnn-a0.5-t1-05-025 mnist1d 0.5 "1,0.5,0.25" "$CNN" 0,1,2
  f mnist1d-cnn-a0.1-t1-0125   mnist1d 0.1 "1,0.125"    "$CNN" 0,1,2
fi
echo "$(date +%T) lane B3$1 finished"
} >> $OUT/queue-B3$1.log 2>&1
