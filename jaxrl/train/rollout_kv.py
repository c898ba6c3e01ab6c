"""The rollout's K/V as MetroRLHF's cache (`trainer.kv_source=rollout`): every finished sequence's K/V, exported
by the engine on its instance's devices (`rollout.SequenceKV`), moved to the train mesh and gathered into the
packed layout of each fixed-shape micro-batch, [layers, rows, row length, kv heads, head dim], without a host
round trip.

    stager = KVStager(cfg, mesh, capacity_tokens, dtype)
    offsets = stager.stage([c.kv for c in completions])            # device_put to the train mesh + write
    idx = stager.index(rows, offsets, cached, lengths, j * local_rows, local_rows, row_len)
    k, v = stager.packed(idx)                                      # micro-batch j's cache, global rows

Several processes: each process's instances hold only its own sequences, and `rl.micro_batches` gives every
process `local_rows = mb_rows // process_count` rows of each micro-batch, its own samples'. So each process
stages its sequences into a process-local buffer (replicated over its own devices of the train mesh,
`mesh.local_mesh`), gathers its local rows there, straight into the shards its devices hold of the global
micro-batch, and the global [layers, mb_rows, ...] cache is assembled from those shards without a copy
(`jax.make_array_from_single_device_arrays`). Its rows land where `jax.make_array_from_process_local_data`
puts the process's token rows (the same row sharding; checked per shape, `_check_rows`). One process: the
local mesh is the train mesh and nothing is assembled (the same executables as before).

Shapes stay bounded: the staging buffers have a fixed capacity (the step's sequences at their bucketed
exported lengths, plus one zero slot), a sequence is written with one jitted update per exported shape (a
`fine_bucket` of pages), and the gather has the micro-batch's fixed shape. Slots that hold no cached K/V
(row padding, each sequence's last token, whose K/V the engine never computes) point at the zero slot; the
blockwise step never reads them as history (`jaxrl.train.blockwise`: a block reads only earlier positions of
its own segments).

Numerics: the cache holds the engine's K/V (its prefill/decode kernels, the cache dtype), the train step
computes the block's own K/V with the train forward; the difference to kv_source=recompute is measured in
tests/test_blockwise_rollout.py and the README. Valid on-policy only (the config refuses it otherwise).

Simplified / left out: the staging buffers are replicated over the (process's) train mesh devices (a
production version would put each sequence on the data shard that trains it); the K/V do not move between
processes, so the config refuses `trainer.repartition=tokens` (samples moved to another process) with
several processes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl.rollout.shapes import fine_bucket
from models import ModelConfig


def export_pages(cfg) -> tuple[int, int]:
    """(page size, pages of the longest sequence) of the rollout's exports (a `TrainConfig`): `KVStager.warm`'s."""
    ps = cfg.engine.page_size
    return ps, -(-(cfg.data.max_prompt_len + cfg.rollout.max_new_tokens) // ps)


def kv_capacity(cfg) -> int:
    """Tokens of one step's exported rollout K/V at most (a `TrainConfig`): every sequence of the step at its
    largest page bucket."""
    ps = cfg.engine.page_size
    pages = -(-(cfg.data.max_prompt_len + cfg.rollout.max_new_tokens) // ps)
    return cfg.algo.prompts_per_step * cfg.algo.group_size * fine_bucket(pages) * ps


@jax.jit
def _write(buf, x, offset):
    return lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), offset, axis=1)


class KVStager:
    """Fixed-capacity K/V staging on (this process's devices of) the train mesh; `packed` gathers micro-batches
    out of it, each process its own rows."""

    def __init__(self, cfg: ModelConfig, mesh, capacity_tokens: int, dtype):
        self._made = (cfg, capacity_tokens, dtype)
        self.capacity = int(capacity_tokens)
        self.zero = self.capacity                        # one extra, never-written slot of zeros
        mine = all(d.process_index == jax.process_index() for d in mesh.devices.flat)
        self.processes = 1 if mine else jax.process_count()     # (a mesh of this process's devices: its own)
        rows = P(None, ("dp", "fsdp"), None, None, None)
        self.out_sharding = NamedSharding(mesh, rows)
        local = mesh if self.processes == 1 else Mesh(mesh.local_mesh.devices, mesh.axis_names,
                                                      axis_types=mesh.axis_types)
        self.stage_sharding = NamedSharding(local, P())
        self.local_sharding = self.out_sharding if self.processes == 1 else NamedSharding(local, rows)
        self._checked: set[int] = set()
        shape = (cfg.num_layers, self.capacity + 1, cfg.num_kv_heads, cfg.head_dim)
        zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=self.stage_sharding)
        self.k, self.v = zeros(), zeros()
        self._gather = jax.jit(lambda k, v, idx: (k[:, idx], v[:, idx]),
                               out_shardings=(self.local_sharding, self.local_sharding))
        self._write = jax.jit(_write, donate_argnums=(0,), out_shardings=self.stage_sharding)

    def like(self, mesh) -> "KVStager":
        """A stager of the same capacity and dtype on another mesh (the stream trainer's freed devices)."""
        cfg, capacity, dtype = self._made
        return KVStager(cfg, mesh, capacity, dtype)

    def stage(self, seqs) -> list[int]:
        """Write each `SequenceKV` (this process's) into the buffers (from offset 0: a new step); returns their
        offsets."""
        offsets, off = [], 0
        for s in seqs:
            n = s.k.shape[1]
            if off + n > self.capacity:
                raise ValueError(f"rollout K/V of {len(seqs)} sequences exceed the staging capacity "
                                 f"{self.capacity} tokens")
            k = jax.device_put(s.k, self.stage_sharding)          # on-device reshard from the instance
            v = jax.device_put(s.v, self.stage_sharding)
            self.k, self.v = self._write(self.k, k, np.int32(off)), self._write(self.v, v, np.int32(off))
            offsets.append(off)
            off += n
        return offsets

    def index(self, rows: list[list[int]], offsets: list[int], cached: list[int], lengths: list[int],
              first_row: int, n_rows: int, row_len: int) -> np.ndarray:
        """[n_rows, row_len] staging slots of micro-batch rows first_row.. (the packing `rows`: sample indices
        in row order; `lengths[i]` tokens of sample i, the first `cached[i]` of them cached). Several processes:
        this process's rows (`rows` is its own packing, n_rows its share of a micro-batch)."""
        idx = np.full((n_rows, row_len), self.zero, np.int32)
        for r in range(n_rows):
            off = 0
            for i in rows[first_row + r] if first_row + r < len(rows) else ():
                idx[r, off:off + cached[i]] = offsets[i] + np.arange(cached[i])
                off += lengths[i]
        return idx

    def packed(self, idx: np.ndarray):
        """(K, V) [layers, rows, row_len, kv_heads, head_dim] of one micro-batch, rows on the data axes. `idx`:
        this process's rows (`index`); the result has every process's, rows = idx rows x processes."""
        k, v = self._gather(self.k, self.v, jax.device_put(idx, self.stage_sharding))
        if self.processes == 1:
            return k, v
        return self._assemble(k), self._assemble(v)

    def _assemble(self, x):
        """The global micro-batch cache whose shards on this process's devices are `x`'s (its local rows)."""
        self._check_rows(x.shape[1])
        shape = (x.shape[0], x.shape[1] * self.processes) + x.shape[2:]
        shards = {s.device: s.data for s in x.addressable_shards}
        devices = self.out_sharding.addressable_devices_indices_map(shape)
        return jax.make_array_from_single_device_arrays(shape, self.out_sharding, [shards[d] for d in devices])

    def _check_rows(self, n_local: int):
        """Each device's local rows are the ones `jax.make_array_from_process_local_data` gives it of the
        process's rows (`rl.micro_batches` places the token rows so): its global row block's rank among the
        process's blocks, times the block size. A mesh where that fails raises instead of mixing up rows."""
        if n_local in self._checked:
            return
        glob = self.out_sharding.addressable_devices_indices_map((1, n_local * self.processes, 1, 1, 1))
        loc = self.local_sharding.addressable_devices_indices_map((1, n_local, 1, 1, 1))
        starts = sorted({g[1].start or 0 for g in glob.values()})
        block = n_local // len(starts)
        for d, g in glob.items():
            if (loc[d][1].start or 0) != starts.index(g[1].start or 0) * block:
                raise ValueError(f"rollout K/V: device {d} holds local rows from {loc[d][1].start} of the process's "
                                 f"{n_local}, but its global rows {g[1]} are block {starts.index(g[1].start or 0)} "
                                 f"of {len(starts)} (global row sharding {self.out_sharding.spec})")
        self._checked.add(n_local)

    def warm(self, page_size: int, max_pages: int, n_rows: int, row_len: int):
        """Run every write shape (each exported page bucket) and the micro-batch gather (n_rows: a micro-batch's
        global rows; each process gathers its share) once, on zeros, so a run compiles none of them later (the
        buffers are overwritten from offset 0 every step)."""
        L, _, K, D = self.k.shape
        for b in sorted({fine_bucket(p) for p in range(1, max_pages + 1)}):
            x = jax.device_put(np.zeros((L, b * page_size, K, D), self.k.dtype), self.stage_sharding)
            self.k, self.v = self._write(self.k, x, np.int32(0)), self._write(self.v, x, np.int32(0))
        jax.block_until_ready(self.packed(np.full((n_rows // self.processes, row_len), self.zero, np.int32)))

    def abstract(self, n_rows: int, row_len: int):
        """ShapeDtypeStructs of `packed`'s outputs (for warm-up): n_rows global rows."""
        L, _, K, D = self.k.shape
        s = jax.ShapeDtypeStruct((L, n_rows, row_len, K, D), self.k.dtype, sharding=self.out_sharding)
        return s, s
