#!/usr/bin/env bash
# Start N local processes of the same command under jax.distributed (multi-controller, DistFlow style):
#   scripts/launch_local.sh 2 python -m jaxrl.train train_layout.fsdp=8 engine.instances=4
# Each process gets JAX_COORDINATOR_ADDRESS (a free localhost port), JAX_NUM_PROCESSES and
# JAX_PROCESS_ID; process i's output goes to stdout prefixed with [i]. Exits non-zero if any process
# fails, and kills the others when one fails or on Ctrl-C.
set -euo pipefail
n=${1:?usage: scripts/launch_local.sh N COMMAND [ARGS...]}
shift
[ "$#" -gt 0 ] || { echo "usage: scripts/launch_local.sh N COMMAND [ARGS...]" >&2; exit 2; }
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup INT TERM
for ((i = 0; i < n; i++)); do
  JAX_COORDINATOR_ADDRESS="127.0.0.1:$port" JAX_NUM_PROCESSES="$n" JAX_PROCESS_ID="$i" \
    "$@" > >(sed -u "s/^/[$i] /") 2>&1 &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do
  if ! wait "$p"; then status=1; cleanup; fi
done
exit $status
