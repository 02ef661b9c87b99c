#!/bin/bash
# issue 13 benchmark queue: every tier cell rerun at one commit (snapshot worktree /work/snap-13c at 0392df5).
# usage: queue.sh LANE   (A: MLP cells, B: CNN/ViT + one-shot, then FedDF passes)
set -u
cd /work/snap-13c
export OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
PY="nice -n 10 /work/main/.venv/bin/python -m simulations.runners.sweep --engine inprocess --partitions dirichlet --seeds 0,1,2"
T=/work/main/results/tiers
COMMON="local-epochs=1 num-clients=10 num-server-rounds=30 batch-size=32 min-train-nodes=5 fusion-set-size=300"
MLP="model='mlp' optimizer='sgd' lr=0.2 model-width=256 model-depth=2"
CNN="model='cnn' optimizer='sgd' lr=0.2 model-width=32 model-depth=2"
VIT="model='vit' optimizer='adam' lr=0.005 model-width=64 model-depth=2"
# cell NAME DATASET ALPHA TIERS MODELCFG SMALLEST_WIDTH
cell() {
  local name=$1 ds=$2 a=$3 tiers=$4 model=$5 small=$6 extra=${7:-}
  local full="0,3,6,9" nfull=4 stier=0.25
  if [ "$tiers" = "1,0.125" ]; then full="0,2,4,6,8"; nfull=5; stier=0.125; fi
  local cfg="dataset='$ds' dirichlet-alpha=$a $COMMON $model client-tiers='$tiers'"
  local strat="heterofl,fedrolex,average,average[ordered-dropout='off'],heterofl[ordered-dropout='on'],fedavg[model-width=$small client-tiers='' sweep-as-tier=$stier],fedavg[client-tiers='' min-train-nodes=$nfull sweep-partitions='$full' sweep-as-tier=1]"
  if [ "$extra" = feddf ]; then strat=feddf; fi
  echo "$(date +%T) start $name $extra" >> $T/queue-$LANE.log
  $PY --strategies "$strat" --run-config "$cfg" --out $T/$name >> $T/$name.log 2>&1
  echo "$(date +%T) done $name $extra" >> $T/queue-$LANE.log
}
oneshot() {
  local name=$1 ds=$2 a=$3 model=$4
  local cfg="dataset='$ds' dirichlet-alpha=$a mode='one-shot' num-server-rounds=1 local-epochs=20 num-clients=10 batch-size=32 min-train-nodes=5 fusion-set-size=300 $model client-tiers='1,0.5,0.25'"
  echo "$(date +%T) start $name" >> $T/queue-$LANE.log
  $PY --strategies "heterofl,kd,feddf,kf-linear,kf-linear[ordered-dropout='off'],kf-gradient,ot,kf-linear[tier-models='fuse'],kf-gradient[tier-models='fuse']" --run-config "$cfg" --out $T/$name >> $T/$name.log 2>&1
  echo "$(date +%T) done $name" >> $T/queue-$LANE.log
}
LANE=$1
if [ "$LANE" = A ]; then
  for ds in mnist1d digits; do
    cell $ds-mlp-a0.1-t1-05-025 $ds 0.1 "1,0.5,0.25" "$MLP" 64
    cell $ds-mlp-a0.1-t1-0125   $ds 0.1 "1,0.125"    "$MLP" 32
    cell $ds-mlp-a0.5-t1-05-025 $ds 0.5 "1,0.5,0.25" "$MLP" 64
    cell $ds-mlp-a0.5-t1-0125   $ds 0.5 "1,0.125"    "$MLP" 32
  done
  for c in mnist1d-mlp-a0.1-t1-05-025:mnist1d:0.1:1,0.5,0.25 mnist1d-mlp-a0.1-t1-0125:mnist1d:0.1:1,0.125 mnist1d-mlp-a0.5-t1-05-025:mnist1d:0.5:1,0.5,0.25 mnist1d-mlp-a0.5-t1-0125:mnist1d:0.5:1,0.125 digits-mlp-a0.1-t1-05-025:digits:0.1:1,0.5,0.25 digits-mlp-a0.5-t1-05-025:digits:0.5:1,0.5,0.25 digits-mlp-a0.1-t1-0125:digits:0.1:1,0.125 digits-mlp-a0.5-t1-0125:digits:0.5:1,0.125; do
    IFS=: read n ds a t <<< "$c"; cell $n $ds $a $t "$MLP" 0 feddf
  done
fi
if [ "$LANE" = B ]; then
  cell mnist1d-cnn-a0.1-t1-05-025 mnist1d 0.1 "1,0.5,0.25" "$CNN" 8
  cell digits-cnn-a0.1-t1-05-025  digits  0.1 "1,0.5,0.25" "$CNN" 8
  cell digits-vit-a0.1-t1-05-025  digits  0.1 "1,0.5,0.25" "$VIT" 16
  oneshot oneshot-mnist1d-mlp-a0.5 mnist1d 0.5 "$MLP"
  oneshot oneshot-digits-mlp-a0.5  digits  0.5 "$MLP"
  oneshot oneshot-digits-cnn-a0.5  digits  0.5 "$CNN"
  oneshot oneshot-mnist1d-cnn-a0.5 mnist1d 0.5 "$CNN"
  oneshot oneshot-digits-vit-a0.5  digits  0.5 "$VIT"
  cell mnist1d-cnn-a0.5-t1-05-025 mnist1d 0.5 "1,0.5,0.25" "$CNN" 8
  cell mnist1d-cnn-a0.1-t1-0125   mnist1d 0.1 "1,0.125"    "$CNN" 4
  cell mnist1d-cnn-a0.1-t1-05-025 mnist1d 0.1 "1,0.5,0.25" "$CNN" 0 feddf
  cell digits-cnn-a0.1-t1-05-025  digits  0.1 "1,0.5,0.25" "$CNN" 0 feddf
  cell digits-vit-a0.1-t1-05-025  digits  0.1 "1,0.5,0.25" "$VIT" 0 feddf
  cell mnist1d-cnn-a0.5-t1-05-025 mnist1d 0.5 "1,0.5,0.25" "$CNN" 0 feddf
  cell mnist1d-cnn-a0.1-t1-0125   mnist1d 0.1 "1,0.125"    "$CNN" 0 feddf
  oneshot oneshot-mnist1d-mlp-a0.1 mnist1d 0.1 "$MLP"
  oneshot oneshot-digits-mlp-a0.1  digits  0.1 "$MLP"
fi
echo "$(date +%T) lane $LANE finished" >> $T/queue-$LANE.log
