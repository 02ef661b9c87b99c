#!/usr/bin/env bash
# One device session's checks, as one script: the CUDA tests (scripts/gpu_check.sh's, tests only) and issue 59 item
# 4's bench (simulations/bench/fmnist_resnet.py: torchvision ResNet-18 clients, the one-shot rows) within a budget.
#   bash scripts/gpu_item4.sh OUT [BUDGET_S]
# Needs Fashion-MNIST's idx files where fedfuse finds them (Debian's folder) and a python3 with torch + CUDA and
# fedfuse's fusion dependencies (POT, captum, Torch-Pruning, timm, torchvision, scipy); Flower is not needed.
set -uo pipefail
out=${1:?usage: bash scripts/gpu_item4.sh OUT [BUDGET_S]}
budget=${2:-360}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE MPLBACKEND=Agg
rc=0
GPU_CHECK_TESTS_ONLY=1 GPU_CHECK_TEST_TIMEOUT=${GPU_TEST_TIMEOUT:-150} bash scripts/gpu_check.sh "$out" "$py" || rc=1
"$py" -m simulations.bench.fmnist_resnet run --device cuda --budget-s "$budget" --pooled --out "$out/resnet" \
    2>&1 | tail -n 60 || rc=1
exit $rc
