"""Multi-controller set-up (DistFlow: every process runs the same program on its own data shard).

`initialize(section, local_cpu_devices)` starts `jax.distributed` when a coordinator and more than one
process are configured (flags, else JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID).
On a CPU host it also sets the number of fake local devices and the gloo collectives, which must
happen before JAX creates its backend. Only scalars cross processes here (`global_sum`); batches are
assembled as global arrays from process-local pieces, never gathered on process 0, and weights reach
the rollout instances by an on-device reshard (`sharding.to_local_groups`).
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.experimental import multihost_utils

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


def global_sum(x) -> np.ndarray:
    """Sum of a small host array over all processes (identical result on every process), in float64.

    Values cross processes as JAX arrays, float32 with x64 off: each is sent as two float32 parts, hi =
    f32(x) and lo = f32(x − hi), so the sum keeps ~48 bits (a float64 sum of float64 sums, to ~1e-14
    relative) instead of float32's 24 (the PPO advantages' whitening sums need it: N processes then
    whiten as one does)."""
    x = np.asarray(x, np.float64)
    if jax.process_count() == 1:
        return x
    hi = x.astype(np.float32)
    lo = (x - hi.astype(np.float64)).astype(np.float32)
    parts = np.asarray(multihost_utils.process_allgather(np.stack([hi, lo])), np.float64)
    return parts.sum(axis=(0, 1))


def global_max(x: int) -> int:
    if jax.process_count() == 1:
        return int(x)
    return int(np.max(multihost_utils.process_allgather(np.asarray([x], np.int64))))


def allgather(x) -> np.ndarray:
    """A small host array of every process, stacked on a new first axis (in process order); one process:
    `x[None]`. Every process must call it with the same shape. Across processes the values travel as JAX
    arrays: with x64 off (the default) int64/float64 come back as int32/float32."""
    x = np.asarray(x)
    if jax.process_count() == 1:
        return x[None]
    return np.asarray(multihost_utils.process_allgather(x)).reshape(jax.process_count(), *x.shape)


def gather_ragged(x) -> np.ndarray:
    """The concatenation, in process order, of a 1-D host array whose length differs per process. The gather
    runs at the longest length rounded up to a power of two, so a run's varying lengths (dynamic sampling,
    tail batching) reuse a few compiled gathers instead of compiling one per new length."""
    x = np.asarray(x).ravel()
    if jax.process_count() == 1:
        return x
    n = allgather(np.asarray([len(x)], np.int64))[:, 0]
    padded = np.zeros(1 << max(0, int(n.max()) - 1).bit_length(), x.dtype)
    padded[:len(x)] = x
    every = allgather(padded)
    return np.concatenate([every[p, :k] for p, k in enumerate(n)])


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
