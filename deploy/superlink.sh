#!/usr/bin/env bash
# Start the fedfuse SuperLink (one per federation).
#
#   deploy/superlink.sh                       # secure default: TLS (deploy/certs) + SuperNode authentication
#   FEDFUSE_INSECURE=1 deploy/superlink.sh    # local tests only: no TLS, no node auth
#
# Environment: HOST (default 0.0.0.0 = reachable from other machines), PORT (default 9092: Fleet, Control
# and Runtime APIs share this one port in flwr 1.41), CERTS (default deploy/certs, from gen_certs.py),
# DATABASE (default $FLWR_HOME/superlink.db, so registered SuperNodes and runs survive a restart).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
source "$ROOT/scripts/env.sh"
HOST=${HOST:-0.0.0.0}
PORT=${PORT:-9092}
CERTS=${CERTS:-$ROOT/deploy/certs}
export FLWR_HOME=${FLWR_HOME:-$HOME/.flwr}
mkdir -p "$FLWR_HOME"
DATABASE=${DATABASE:-$FLWR_HOME/superlink.db}
BIN="$ROOT/.venv/bin"
export PATH="$BIN:$PATH"   # flower-superlink/-supernode start flower-superexec (and flwr-*app) by name

args=(--host "$HOST" --port "$PORT" --database "$DATABASE" --disable-runtime-dependency-installation)
if [ "${FEDFUSE_INSECURE:-0}" = "1" ]; then
  echo "WARNING: --insecure (no TLS, no SuperNode authentication): local tests only" >&2
  args+=(--insecure)
else
  for f in ca.crt server.pem server.key; do
    [ -f "$CERTS/$f" ] || { echo "missing $CERTS/$f: run .venv/bin/python deploy/gen_certs.py --out $CERTS --host <name> --ip <addr>" >&2; exit 2; }
  done
  args+=(--ssl-ca-certfile "$CERTS/ca.crt" --ssl-certfile "$CERTS/server.pem" --ssl-keyfile "$CERTS/server.key"
         --enable-supernode-auth)
fi
exec "$BIN/flower-superlink" "${args[@]}" "$@"
