#!/bin/bash
# lane C at 9983f46 (+ tiers.sh one-shot lists), snapshot /work/snap-13e: one-shot cells (distill default, OD off),
# the digits ViT cell's fedfuse rows (tier-models auto = slice for ViTs)
cd /work/snap-13e
export PYTHON=/work/main/.venv/bin/python
source <(sed -n '/^cell() {/,/^}/p;/^oneshot() {/,/^}/p' simulations/bench/tiers.sh)
OUT=/work/main/results/tiers
export OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
PY="nice -n 10 $PYTHON -m simulations.runners.sweep --engine inprocess --partitions dirichlet --seeds 0,1,2"
eval "$(grep -E '^(COMMON|MLP|CNN|VIT|MLP1|CNN1)=' simulations/bench/tiers.sh)"
{
  rm -rf $OUT/oneshot-*
  oneshot oneshot-digits-cnn-a0.5  digits  0.5 "$CNN1"
  oneshot oneshot-digits-mlp-a0.5  digits  0.5 "$MLP1"
  oneshot oneshot-mnist1d-mlp-a0.5 mnist1d 0.5 "$MLP1"
  oneshot oneshot-mnist1d-cnn-a0.5 mnist1d 0.5 "$CNN1"
  oneshot oneshot-digits-vit-a0.5  digits  0.5 "$VIT"
  echo "$(date +%T) vit rows"
  $PY --strategies "average,average[ordered-dropout='off']" --run-config "dataset='digits' dirichlet-alpha=0.1 $COMMON $VIT client-tiers='1,0.5,0.25'" --out $OUT/vit-rows-tmp >> $OUT/vit-rows-tmp.log 2>&1
  oneshot oneshot-mnist1d-mlp-a0.1 mnist1d 0.1 "$MLP1"
  oneshot oneshot-digits-mlp-a0.1  digits  0.1 "$MLP1"
  oneshot oneshot-digits-cnn-a0.1  digits  0.1 "$CNN1"
  oneshot oneshot-mnist1d-cnn-a0.1 mnist1d 0.1 "$CNN1"
  echo "$(date +%T) lane C finished"
} >> $OUT/queue-C.log 2>&1
