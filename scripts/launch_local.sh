#!/usr/bin/env bash
# Start N local processes of the same command under jax.distributed (multi-controller, DistFlow style):
#   scripts/launch_local.sh 2 python -m jaxrl.train train_layout.fsdp=8 engine.instances=4
# The command runs in the caller's directory inside the project's virtual environment (scripts/venv.sh
# creates or syncs it once, before any process starts; its bin/ goes first on PATH, so `python` is the
# environment's). Each process gets JAX_COORDINATOR_ADDRESS (a free localhost port), JAX_NUM_PROCESSES
# and JAX_PROCESS_ID; process i's output goes to stdout prefixed with [i]. When any process fails (or
# on Ctrl-C) the others are killed, and the exit status is the first failure's.
#   scripts/launch_local.sh --srun N COMMAND ...   the variables SLURM's srun sets instead (one node,
# localhost; the job id chosen so that the coordinator port jax.distributed derives from it is free), and no
# JAX_* ones: the processes join as a task of an srun step would (docs/cluster.md).
set -euo pipefail
((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] >= 501)) || { echo "launch_local.sh needs bash >= 5.1 (wait -n -p)" >&2; exit 2; }
usage="usage: scripts/launch_local.sh [--srun] N COMMAND [ARGS...]"
srun=0
if [ "${1:-}" = "--srun" ]; then srun=1; shift; fi
n=${1:?$usage}
shift
[[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "$usage (N: a number of processes, got '$n')" >&2; exit 2; }
[ "$#" -gt 0 ] || { echo "$usage" >&2; exit 2; }
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="$("$here/venv.sh" printenv VIRTUAL_ENV)"
export VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH"
unset PYTHONHOME
port=$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# srun: a job id whose port (jax/_src/clusters/slurm_cluster.py: 61440 + id % 4096) is free here
[ "$srun" = 0 ] || job=$(python -c '
import random, socket
for _ in range(200):
    p = random.randrange(61440, 65536)
    try:
        socket.create_server(("", p)).close()
    except OSError:
        continue
    print(random.randrange(1, 200) * 4096 + p - 61440)
    break')
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup INT TERM
for ((i = 0; i < n; i++)); do
  if [ "$srun" = 1 ]; then
    env -u JAX_COORDINATOR_ADDRESS -u JAX_NUM_PROCESSES -u JAX_PROCESS_ID SLURM_JOB_ID="$job" SLURM_JOBID="$job" \
      SLURM_STEP_ID=0 SLURM_NTASKS="$n" SLURM_NPROCS="$n" SLURM_PROCID="$i" SLURM_LOCALID="$i" SLURM_NODEID=0 \
      SLURM_STEP_NODELIST=localhost SLURM_NODELIST=localhost SLURM_STEP_NUM_NODES=1 SLURM_NNODES=1 \
      SLURM_STEP_NUM_TASKS="$n" SLURM_TASKS_PER_NODE="$n" \
      "$@" > >(sed -u "s/^/[$i] /") 2>&1 &
  else
    JAX_COORDINATOR_ADDRESS="127.0.0.1:$port" JAX_NUM_PROCESSES="$n" JAX_PROCESS_ID="$i" \
      "$@" > >(sed -u "s/^/[$i] /") 2>&1 &
  fi
  pids+=($!)
done
# Reap whichever process ends first (wait -n), so a failure is seen at once while others still run.
status=0
running=("${pids[@]}")
while [ "${#running[@]}" -gt 0 ]; do
  rc=0
  done_pid=
  wait -n -p done_pid "${running[@]}" || rc=$?
  if [ -z "${done_pid:-}" ]; then   # a signal interrupted the wait (the trap killed the others)
    [ "$status" -ne 0 ] || status=$rc
    [ "$rc" -ne 127 ] || break    # no child left to wait for
    continue
  fi
  left=()
  for p in "${running[@]}"; do [ "$p" = "$done_pid" ] || left+=("$p"); done
  running=("${left[@]}")
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; cleanup; fi
done
exit "$status"
