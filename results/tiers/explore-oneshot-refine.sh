#!/bin/bash
# one-shot tier cells: kf-linear with distillation refinement (explore), snapshot /work/snap-13d
cd /work/snap-13d
export OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1
eval "$(grep -E '^(VIT|MLP1|CNN1)=' simulations/bench/tiers.sh)"
for c in "digits:$CNN1:cnn" "digits:$MLP1:mlp" "mnist1d:$CNN1:cnn" "mnist1d:$MLP1:mlp"; do
  IFS=: read ds m n <<< "$c"
  nice -n 15 /work/main/.venv/bin/python -m simulations.runners.sweep --engine inprocess --partitions dirichlet --seeds 0,1,2 \
    --strategies "kf-linear[refine='distill'],kf-linear[refine='calibrate+distill']" \
    --run-config "dataset='$ds' dirichlet-alpha=0.5 mode='one-shot' num-server-rounds=1 local-epochs=20 num-clients=10 batch-size=32 min-train-nodes=5 fusion-set-size=300 $m client-tiers='1,0.5,0.25'" \
    --out /work/main/results/tiers/explore-oneshot-refine-$ds-$n >> /work/main/results/tiers/explore-oneshot-refine.log 2>&1
done
