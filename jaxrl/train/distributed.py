"""Multi-controller set-up (DistFlow: every process runs the same program on its own data shard).

`initialize(section, local_cpu_devices)` joins the run: it starts `jax.distributed` when the run has more
than one process, then asks for this process's fake CPU devices and the gloo collectives (both before JAX
creates its backend). Who decides the run's processes (`launch`), first that applies:

1. explicit settings: the `distributed.*` keys, else JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
   JAX_PROCESS_ID (what `scripts/launch_local.sh` sets); a value they leave out is detected as in 2;
2. the launcher, detected by `jax.distributed.initialize()` itself (its cluster plugins,
   `jax/_src/clusters`): `mpirun` of Open MPI (OMPI_MCA_orte_hnp_uri), `srun` of SLURM (SLURM_JOB_ID,
   SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID) and a Kubernetes Indexed Job
   (JOB_COMPLETION_INDEX; the Job's parallelism and the coordinator from the Kubernetes API, which needs the
   `kubernetes` package). The coordinator, the process count and the index are JAX's, never parsed here;
3. else one process.

The launchers' variables are read here only to log which one started the process and to stop in one line,
before any work, where JAX would take an environment halfway (a KeyError deep in its detection, or a wait
for processes that never come): `srun`'s variables without a size, Open MPI's without the URI JAX reads
(Open MPI 5), a SLURM job of several tasks whose process was not started by `srun`, an Indexed Job without
the `kubernetes` package. A launcher environment of one process (`srun -n 1`, `mpirun -np 1`, a batch script
run without `srun`, a Kubernetes pod outside an Indexed Job) is the single-process run it describes. A
coordinator address given by the settings that does not answer is one line after the initialization timeout
(`reach`; JAX's own client aborts with a C++ stack trace). Every
process logs one line: who launched it, its index and the count, and the coordinator (docs/cluster.md).

Only small host arrays cross processes here (`global_sum`, `allgather`: counts, lengths, rewards); batches
are assembled as global arrays from process-local pieces, never gathered on process 0, and weights reach the
rollout instances by an on-device reshard (`sharding.to_local_groups`).

The host agreements travel through the coordination service's key-value store (`exchange`), not as XLA
collectives: their values keep their dtype (float64 sums are exact), no shape compiles a gather, and they
never interleave with the device collectives of a computation another thread runs (one-step-async trains
on the train pool's thread while the next rollout's agreements run on the main thread). Each call site
names its stream (`tag`): the calls of one stream happen in the same order on every process, which is
what numbers their keys.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping

import jax
import numpy as np
from jax._src import distributed as jax_distributed

from jaxrl.config.train import DistributedSection
from jaxrl.runtime import request_cpu_devices

MPIRUN, SRUN, K8S = "mpirun (Open MPI)", "srun (SLURM)", "Kubernetes Indexed Job"
# The variables JAX's SLURM plugin needs, all of them (`jax/_src/clusters/slurm_cluster.py`)
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
OMPI_URI = "OMPI_MCA_orte_hnp_uri"     # Open MPI 4's mpirun sets it; JAX's Open MPI plugin looks for nothing else
OMPI_VARS = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")


class LaunchError(ValueError):
    """A launch environment that cannot start this run; the message is one line naming the variable."""


@dataclasses.dataclass(frozen=True)
class Launch:
    """How this process joins the run (`launch`). `coordinator`, `num_processes`, `process_id`: what
    `jax.distributed.initialize` is given, None where JAX's cluster detection fills it in; `processes`: the
    count known before JAX starts (None: only JAX's detection knows it, a Kubernetes Job's parallelism);
    `source`: who decided, for the start-up line."""

    source: str
    distributed: bool
    coordinator: str | None = None
    num_processes: int | None = 1
    process_id: int | None = 0
    processes: int | None = 1


def _int(environ: Mapping[str, str], name: str, *, minimum: int = 0) -> int:
    value = environ.get(name, "")
    try:
        out = int(value)
    except ValueError:
        out = None
    if out is None or out < minimum:
        raise LaunchError(f"{name}={value!r}: expected an integer >= {minimum}")
    return out


def detect(environ: Mapping[str, str] = os.environ) -> tuple[str, int | None] | None:
    """The launcher `jax.distributed.initialize()` would detect (its checks, in its order: Open MPI, SLURM,
    Kubernetes) and the process count it states (None: JAX asks the Kubernetes API); None: no launcher, or a
    launcher environment of one process outside it (then `(description, 1)`). A launcher environment JAX would
    take halfway is a LaunchError (module docstring)."""
    if OMPI_URI in environ:
        missing = [v for v in OMPI_VARS if v not in environ]
        if missing:
            raise LaunchError(f"{OMPI_URI} is set (a process of Open MPI's mpirun) but {', '.join(missing)} "
                              "is not: start the processes with mpirun -np N, not by hand")
        size = _int(environ, "OMPI_COMM_WORLD_SIZE", minimum=1)
        rank = _int(environ, "OMPI_COMM_WORLD_RANK")
        _int(environ, "OMPI_COMM_WORLD_LOCAL_RANK")
        if rank >= size:
            raise LaunchError(f"OMPI_COMM_WORLD_RANK={rank} not in [0, OMPI_COMM_WORLD_SIZE={size})")
        return MPIRUN, size
    if "OMPI_COMM_WORLD_SIZE" in environ and environ["OMPI_COMM_WORLD_SIZE"] != "1":
        raise LaunchError(f"OMPI_COMM_WORLD_SIZE={environ['OMPI_COMM_WORLD_SIZE']} without {OMPI_URI}: an MPI "
                          "launcher JAX does not detect (Open MPI 5's mpirun, another MPI); use Open MPI 4's "
                          "mpirun, or set JAX_COORDINATOR_ADDRESS=HOST:PORT (rank 0's host), JAX_NUM_PROCESSES "
                          "and JAX_PROCESS_ID for each process (docs/cluster.md)")
    if "SLURM_JOB_ID" in environ:
        job = environ["SLURM_JOB_ID"]
        _int(environ, "SLURM_JOB_ID")             # (JAX derives the coordinator's port from it)
        missing = [v for v in SLURM_VARS if v not in environ]
        tasks = _int(environ, "SLURM_NTASKS", minimum=1) if "SLURM_NTASKS" in environ else None
        if not missing:
            task = _int(environ, "SLURM_PROCID")
            _int(environ, "SLURM_LOCALID")
            if task >= tasks:
                raise LaunchError(f"SLURM_PROCID={task} not in [0, SLURM_NTASKS={tasks})")
            return (SRUN if tasks > 1 else f"srun (SLURM job {job}) with one task"), tasks
        if tasks is not None and tasks > 1:
            raise LaunchError(f"SLURM job {job} has SLURM_NTASKS={tasks} tasks, but this process was not started "
                              f"by srun ({', '.join(missing)} unset): start every task with srun python -m "
                              "jaxrl.train ... (docs/cluster.md)")
        return f"SLURM job {job} without srun", 1
    if "KUBERNETES_SERVICE_HOST" in environ:
        if "JOB_COMPLETION_INDEX" not in environ:
            return "a Kubernetes pod outside an Indexed Job", 1
        index = _int(environ, "JOB_COMPLETION_INDEX")
        if importlib.util.find_spec("kubernetes") is None:
            raise LaunchError(f"a Kubernetes Indexed Job (JOB_COMPLETION_INDEX={index}), but the kubernetes package "
                              "jax.distributed's detection reads the Job through is not installed: pip install "
                              "kubernetes, or set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID in "
                              "the manifest (docs/cluster.md)")
        return K8S, None
    return None


def launch(d: DistributedSection, environ: Mapping[str, str] = os.environ) -> Launch:
    """Who decides this run's processes, and what `jax.distributed.initialize` is given (module docstring).
    LaunchError: a half-configured environment, or settings that contradict each other."""
    coord = d.coordinator or environ.get("JAX_COORDINATOR_ADDRESS") or None
    n = d.num_processes if d.num_processes is not None else (
        _int(environ, "JAX_NUM_PROCESSES", minimum=1) if environ.get("JAX_NUM_PROCESSES") else None)
    pid = d.process_id if d.process_id is not None else (
        _int(environ, "JAX_PROCESS_ID") if environ.get("JAX_PROCESS_ID") else None)
    explicit = coord is not None or n is not None or pid is not None
    if explicit and None not in (coord, n, pid) or n == 1:
        found = None          # everything is given (or one process is): nothing for a launcher to fill in
    else:
        found = detect(environ)
    launcher = found is not None and found[1] != 1      # (one process in a launcher's environment: not a launcher)
    if not explicit:
        if not launcher:
            return Launch(f"single process ({found[0]})" if found else "single process (no launcher detected)",
                          False)
        return Launch(found[0], True, None, None, None, found[1])
    keys = "distributed.* / JAX_* settings" + (f" and {found[0]}" if launcher else "")
    if not launcher:          # (today's defaults: one process, process 0)
        n, pid = (1 if n is None else n), (0 if pid is None else pid)
    if n is not None and n > 1 and not coord and not launcher:
        raise LaunchError(f"{n} processes configured but no coordinator (distributed.coordinator or "
                          "JAX_COORDINATOR_ADDRESS)")
    if n is not None and pid is not None and not 0 <= pid < n:
        raise LaunchError(f"process id {pid} not in [0, {n})")
    if launcher and n is not None and found[1] is not None and n != found[1]:
        raise LaunchError(f"{n} processes configured (distributed.num_processes or JAX_NUM_PROCESSES), but "
                          f"{found[0]} started {found[1]}")
    processes = n if n is not None else found[1]
    if processes == 1:
        return Launch(f"single process ({keys})", False)
    return Launch(keys, True, coord, n, pid, processes)


def reach(address: str, timeout_s: float, who: str) -> None:
    """Wait until `address` (host:port) accepts a TCP connection: a coordinator that never answers (process 0 not
    started, a wrong address, a closed port) is then one LaunchError after `timeout_s`, not the abort with a C++
    stack trace that JAX's client gives. (Under a launcher JAX detects, the address is JAX's: its timeout holds.)"""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1).close()
            return
        except (OSError, ValueError) as e:
            if isinstance(e, ValueError) or time.monotonic() >= deadline:
                raise LaunchError(f"{who} could not reach the coordinator {address} within "
                                  f"distributed.initialization_timeout={timeout_s:g} s: is process 0 running there, "
                                  "with that port open?") from None
            time.sleep(0.1)


def initialize(d: DistributedSection, local_cpu_devices: int | Callable[[int], int]) -> Launch:
    """Join the run (`launch`; LaunchError in one line, also for a coordinator not reached within
    `d.initialization_timeout`), then ask for this process's fake CPU devices (`local_cpu_devices`, or
    `local_cpu_devices(process count)`), and print the start-up line. No effect on GPU/TPU device counts."""
    how = launch(d)
    n, pid, coord = 1, 0, None
    if how.distributed:
        if how.coordinator and how.process_id:        # (JAX's own failure to connect is a C++ abort)
            reach(how.coordinator, d.initialization_timeout, f"process {how.process_id} ({how.source})")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        try:
            jax.distributed.initialize(how.coordinator, num_processes=how.num_processes, process_id=how.process_id,
                                       initialization_timeout=d.initialization_timeout)
        except Exception as e:      # (JAX's detection's RuntimeError, a coordinator not reached in time …)
            first = " ".join(str(e).split())[:300] or type(e).__name__
            raise LaunchError(f"jax.distributed.initialize ({how.source}, coordinator "
                              f"{how.coordinator or 'detected by JAX'}, distributed.initialization_timeout="
                              f"{d.initialization_timeout} s) failed: {first}") from None
        state = jax_distributed.global_state
        n, pid, coord = state.num_processes, state.process_id, state.coordinator_address
    request_cpu_devices(local_cpu_devices(n) if callable(local_cpu_devices) else local_cpu_devices)
    where = f", coordinator {coord}" if coord else ""
    print(f"[train] launch: {how.source}: process {pid} of {n}{where}", flush=True)
    return how


AGREE_TIMEOUT_S = 24 * 3600      # a process may wait a whole long-tail rollout for the others; a lost
                                 # process is the heartbeat's to detect (`jaxrl.train.heartbeat`)
_SEQ: dict[str, itertools.count] = {}
_LOCK = threading.Lock()


def exchange(x, tag: str = "main") -> list[np.ndarray]:
    """Every process's host array `x` (any shape and dtype, each process its own), in process order,
    through the key-value store. `tag`: the stream of calls this one belongs to (module docstring)."""
    x = np.asarray(x)
    n, me = jax.process_count(), jax.process_index()
    if n == 1:
        return [x]
    client = jax_distributed.global_state.client
    with _LOCK:
        k = next(_SEQ.setdefault(tag, itertools.count()))
    buf = io.BytesIO()
    np.save(buf, x, allow_pickle=False)
    client.key_value_set_bytes(f"jaxrl/agree/{tag}/{k}/{me}", buf.getvalue())
    out = [x if p == me else np.load(io.BytesIO(client.blocking_key_value_get_bytes(
        f"jaxrl/agree/{tag}/{k}/{p}", AGREE_TIMEOUT_S * 1000))) for p in range(n)]
    if k:            # every process has posted call k, so each has read call k - 1: its keys can go
        client.key_value_delete(f"jaxrl/agree/{tag}/{k - 1}/{me}")
    return out


def global_sum(x, tag: str = "main") -> np.ndarray:
    """Sum of a small host array over all processes (identical result on every process), in float64,
    summed in process order."""
    x = np.asarray(x, np.float64)
    if jax.process_count() == 1:
        return x
    parts = exchange(x, tag)
    total = parts[0].copy()
    for part in parts[1:]:
        total += part
    return total


def global_max(x: int, tag: str = "main") -> int:
    if jax.process_count() == 1:
        return int(x)
    return int(max(int(v) for v in exchange(np.asarray(x, np.int64), tag)))


def allgather(x, tag: str = "main") -> np.ndarray:
    """A small host array of every process, stacked on a new first axis (in process order); one process:
    `x[None]`. Every process must call it with the same shape; dtypes are kept."""
    x = np.asarray(x)
    if jax.process_count() == 1:
        return x[None]
    return np.stack(exchange(x, tag))


def gather_ragged(x, tag: str = "main") -> np.ndarray:
    """The concatenation, in process order, of a 1-D host array whose length differs per process."""
    x = np.asarray(x).ravel()
    if jax.process_count() == 1:
        return x
    return np.concatenate(exchange(x, tag))


def local_rows(x: jax.Array, sharding) -> np.ndarray:
    """This process's rows of a global array whose rows were assembled from process-local pieces under
    `sharding` (`jax.make_array_from_process_local_data`, rows sharded over the data axes), in order.

    A computed array's own sharding may differ (XLA may return it replicated, or split another way), and
    its addressable rows are then not this process's: it is first laid out on `sharding` (a no-op when it
    already is), then read from this process's shards, replicas over the other mesh axes counted once."""
    if x.sharding != sharding:
        x = _relayout(sharding)(x)
    pieces = {}
    for s in x.addressable_shards:
        pieces.setdefault(s.index[0].start or 0, s.data)
    return np.concatenate([np.asarray(pieces[k]) for k in sorted(pieces)])


_RELAYOUTS: dict = {}


def _relayout(sharding):
    if sharding not in _RELAYOUTS:
        _RELAYOUTS[sharding] = jax.jit(lambda a: a, out_shardings=sharding)
    return _RELAYOUTS[sharding]
