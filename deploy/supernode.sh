#!/usr/bin/env bash
# Start one fedfuse SuperNode (one per client machine, or several on one machine with distinct PORTs).
#
#   deploy/supernode.sh SUPERLINK_ADDRESS PARTITION_ID NUM_PARTITIONS [extra node-config]
#   deploy/supernode.sh 10.0.0.5:9092 0 3                      # TLS + auth key deploy/keys/supernode-0
#   deploy/supernode.sh 10.0.0.5:9092 1 3 "data-root='/data/fl' device='cuda:0'"
#   deploy/supernode.sh 10.0.0.5:9092 2 3 "data-path='/data/fl/node-2.npz'"   # this node's own (private) data file
#   FEDFUSE_INSECURE=1 deploy/supernode.sh 127.0.0.1:9092 0 2  # local tests only
#
# Environment: PORT (this SuperNode's local ClientApp API, default 9094; distinct per SuperNode on one
# host), CA (default deploy/certs/ca.crt), KEY (default deploy/keys/supernode-<PARTITION_ID>; its .pub
# must have been registered: flwr supernode register deploy/keys/supernode-<i>.pub <connection>).
# GPU: the ClientApp uses CUDA when present (device="auto"); pin a GPU with CUDA_VISIBLE_DEVICES=<i>.
set -euo pipefail
[ $# -ge 3 ] || { sed -n '2,16p' "$0"; exit 2; }
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
source "$ROOT/scripts/env.sh"
SUPERLINK=$1; PID=$2; NUM=$3; EXTRA=${4:-}
PORT=${PORT:-9094}
CA=${CA:-$ROOT/deploy/certs/ca.crt}
KEY=${KEY:-$ROOT/deploy/keys/supernode-$PID}
BIN="$ROOT/.venv/bin"
export PATH="$BIN:$PATH"   # flower-superlink/-supernode start flower-superexec (and flwr-*app) by name

args=(--superlink "$SUPERLINK" --port "$PORT" --node-config "partition-id=$PID num-partitions=$NUM $EXTRA")
if [ "${FEDFUSE_INSECURE:-0}" = "1" ]; then
  echo "WARNING: --insecure (no TLS, no node authentication): local tests only" >&2
  args+=(--insecure)
else
  [ -f "$CA" ] || { echo "missing CA certificate $CA (copy ca.crt from the SuperLink machine)" >&2; exit 2; }
  [ -f "$KEY" ] || { echo "missing private key $KEY: run .venv/bin/python deploy/gen_node_keys.py" >&2; exit 2; }
  args+=(--root-certificates "$CA" --auth-supernode-private-key "$KEY")
fi
exec "$BIN/flower-supernode" "${args[@]}"
