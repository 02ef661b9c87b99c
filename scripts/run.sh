#!/usr/bin/env bash
# Set up (idempotent) and run the default federated simulation with `flwr run` (Ray backend).
# Extra arguments go to simulations/runners/run.py, e.g.  bash scripts/run.sh --run-config "strategy='fedavg'"
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
exec .venv/bin/python -m simulations.runners.run "$@"
