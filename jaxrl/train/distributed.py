"""Multi-controller set-up (DistFlow: every process runs the same program on its own data shard).

`initialize(section, local_cpu_devices)` starts `jax.distributed` when a coordinator and more than one
process are configured (flags, else JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID).
On a CPU host it also sets the number of fake local devices and the gloo collectives, which must
happen before JAX creates its backend. Only small host arrays cross processes here (`global_sum`,
`allgather`: counts, lengths, rewards); batches are assembled as global arrays from process-local pieces,
never gathered on process 0, and weights reach the rollout instances by an on-device reshard
(`sharding.to_local_groups`).

The host agreements travel through the coordination service's key-value store (`exchange`), not as XLA
collectives: their values keep their dtype (float64 sums are exact), no shape compiles a gather, and they
never interleave with the device collectives of a computation another thread runs (one-step-async trains
on the train pool's thread while the next rollout's agreements run on the main thread). Each call site
names its stream (`tag`): the calls of one stream happen in the same order on every process, which is
what numbers their keys.
"""

from __future__ import annotations

import io
import itertools
import os
import threading

import jax
import numpy as np
from jax._src import distributed as jax_distributed

from jaxrl.config.train import DistributedSection
from jaxrl.runtime import request_cpu_devices


def settings(d: DistributedSection) -> tuple[str | None, int, int]:
    coord = d.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    n = d.num_processes if d.num_processes is not None else int(os.environ.get("JAX_NUM_PROCESSES", "1"))
    pid = d.process_id if d.process_id is not None else int(os.environ.get("JAX_PROCESS_ID", "0"))
    if n > 1 and not coord:
        raise SystemExit(f"{n} processes configured but no coordinator (distributed.coordinator or "
                         "JAX_COORDINATOR_ADDRESS)")
    if not 0 <= pid < n:
        raise SystemExit(f"process id {pid} not in [0, {n})")
    return coord, n, pid


def initialize(d: DistributedSection, local_cpu_devices: int) -> None:
    coord, n, pid = settings(d)
    request_cpu_devices(local_cpu_devices)   # fake devices; no effect on GPU/TPU
    if n > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coord, num_processes=n, process_id=pid,
                                   initialization_timeout=d.initialization_timeout)


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
