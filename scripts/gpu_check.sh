#!/usr/bin/env bash
# The checks that need a GPU, as one script: the CUDA tests (tests/test_cuda.py and the CUDA cases of the pruning,
# interpolation and Token Fusion tests) and the real-size fusion table on CUDA (issue 24's CUDA column).
#   bash scripts/gpu_check.sh OUT [PYTHON]
# OUT gets gpu.txt, tests.log and one folder per real-size table (table.md, runs.json, cost.png). PYTHON (default:
# .venv/bin/python when present, else python3) must have torch with CUDA and fedfuse's fusion dependencies
# (POT, captum, Torch-Pruning, timm, torchvision, scipy, scikit-learn); Flower is not needed.
set -uo pipefail
out=${1:?usage: bash scripts/gpu_check.sh OUT [PYTHON]}
py=${2:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 MPLBACKEND=Agg
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$out/gpu.txt"
"$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" \
    2>&1 | tee -a "$out/gpu.txt"
rc=0
timeout "${GPU_CHECK_TEST_TIMEOUT:-300}" "$py" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_interpolation.py::test_cuda_matches_cpu \
    tests/test_pruning.py::test_cuda_device tests/test_tofu.py::test_cuda_matches_cpu \
    "tests/test_regmean_fisher.py::test_statistics_and_fusion_run_on_the_device_given" 2>&1 | tee "$out/tests.log" || rc=1
# GPU_CHECK_TESTS_ONLY=1: the tests alone (scripts/gpu_item4.sh runs them before its own bench)
[ -n "${GPU_CHECK_TESTS_ONLY-}" ] && exit $rc
# cheap methods first, so that a run stopped by its time limit has them
methods=ensemble,lp,ot,rebasin,transfusion,feddf,kd,kf-linear,hf-linear,fs-merge,fs-merge-seq,kf-gradient,hf-gradient,auto
bench() {   # name, then real_size's arguments
    local name=$1; shift
    timeout "${GPU_CHECK_BENCH_TIMEOUT:-400}" "$py" -m simulations.bench.real_size --device cuda \
        --timeout "${GPU_CHECK_METHOD_TIMEOUT:-120}" --methods "$methods" --out "$out/$name" "$@" 2>&1 \
        | tee "$out/$name.log" | tail -n 30 || rc=1
}
bench resnet18-cuda --model resnet18 --clients "${GPU_CHECK_RESNET_CLIENTS:-4,10}" --fusion-size 256 --image-size 32
[ -n "${GPU_CHECK_VIT_CLIENTS-2}" ] && bench vit-tiny-cuda --model vit_tiny_patch16_224 \
    --clients "${GPU_CHECK_VIT_CLIENTS-2}" --fusion-size 64
exit $rc
