#!/usr/bin/env bash
# Set up (idempotent) and run the test suite. Slow tests are skipped unless FEDFUSE_SLOW_TESTS=1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
if [ "${FEDFUSE_SLOW_TESTS:-0}" = "1" ]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
exec .venv/bin/python -m pytest -q -m "not slow" "$@"
