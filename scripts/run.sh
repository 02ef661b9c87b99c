#!/usr/bin/env bash
# Set up (idempotent) and run the default federated simulation: fedfuse's default strategy with `flwr run`
# (Ray backend), then FedAvg on the same split and seed, side by side (`fedfuse run` = fedfuse/flower/runner/run.py).
# Extra arguments go to it, e.g.  bash scripts/run.sh --run-config "strategy='kf-linear'" --no-compare --verbose
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
exec .venv/bin/fedfuse run "$@"
