# Environment for fedfuse runs and tests (sourced by the other scripts).
export OMP_WAIT_POLICY=PASSIVE            # OpenMP spin-waits made torch 5-60x slower on shared cores
export FEDFUSE_TORCH_THREADS=${FEDFUSE_TORCH_THREADS:-1}
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
export FLWR_DISABLE_UPDATE_CHECK=1
export FLWR_TELEMETRY_ENABLED=0
export HF_DATASETS_OFFLINE=${HF_DATASETS_OFFLINE:-1}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
export MPLBACKEND=Agg
