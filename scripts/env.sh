# Environment for fedfuse runs and tests (sourced by the other scripts).
export OMP_WAIT_POLICY=PASSIVE            # OpenMP spin-waits made torch 5-60x slower on shared cores
export FEDFUSE_TORCH_THREADS=${FEDFUSE_TORCH_THREADS:-1}
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
export FLWR_DISABLE_UPDATE_CHECK=1
export FLWR_TELEMETRY_ENABLED=0
export HF_DATASETS_OFFLINE=${HF_DATASETS_OFFLINE:-1}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
export MPLBACKEND=Agg
# .venv/bin on PATH: `flwr run` (local simulation) and flower-superlink/-supernode start flower-superlink,
# flower-superexec and flwr-*app by name
_fedfuse_bin="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv/bin"
case ":$PATH:" in *":$_fedfuse_bin:"*) ;; *) export PATH="$_fedfuse_bin:$PATH" ;; esac
unset _fedfuse_bin
