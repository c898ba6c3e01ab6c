"""Global (multi-process) arrays -> process-local copies on groups of this process's devices, on the devices.

A rollout instance lives on one process's devices, while the training weights are global arrays whose
shards sit on every process. `to_local_groups(tree, specs, groups)` makes every process's instance copies
in one collective on-device reshard, with no host round trip:

  1. a *mirror* mesh over every device of every process, one row per instance (each process's devices
     split into contiguous groups of `tp`, processes in order), axes ("dp", "fsdp", "tp") = (rows, 1, tp);
  2. `jax.device_put` of each leaf to `NamedSharding(mirror, spec)`: the rollout spec (only `tp` or
     None entries), so every row holds a full rollout copy, tp-sharded inside the row (XLA's collective
     over the same device set as the source);
  3. each process assembles its own rows into arrays on its groups' meshes from the shards it already
     holds (`jax.make_array_from_single_device_arrays`: no copy).

Every process must call it at the same point with the same `tp` (SPMD). Leaves move one at a time, so the
transient is one leaf's copies.

**Source on a subset of the devices** (StreamRL's disaggregated pools: the train mesh holds some devices of
every process, the instances others). JAX 0.10 refuses a cross-process reshard between different device
sets on the CPU and GPU runtimes, so the mirror is built over the *source's* devices (rows of `tp` per
process, or of 1 — a replicated copy per device — when tp does not divide a process's share), and each
process then moves its first row's copy to its groups with a process-local `device_put` (device to
device, never through the host).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .layout import MESH_AXES, Layout
from .reuse import nested_order


def mirror_mesh(tp: int, devices: Sequence | None = None) -> Mesh:
    """All (or the given) devices of all processes as rows of `tp` contiguous devices of one process each, each
    row in `reuse.nested_order` (the order `reuse.tp_groups` gives rollout instances)."""
    devices = list(jax.devices() if devices is None else devices)
    rows = []
    for p in sorted({d.process_index for d in devices}):
        devs = sorted((d for d in devices if d.process_index == p), key=lambda d: d.id)
        if len(devs) % tp:
            raise ValueError(f"process {p} has {len(devs)} devices, not a multiple of tp={tp}")
        rows += [nested_order(devs[i:i + tp]) for i in range(0, len(devs), tp)]
    grid = np.empty((len(rows), 1, tp), dtype=object)
    for r, row in enumerate(rows):
        for t, d in enumerate(row):
            grid[r, 0, t] = d
    return Mesh(grid, MESH_AXES)


def to_local_groups(tree: Any, specs: Any, groups: Sequence[Sequence], tp: int) -> list[Any]:
    """One copy of `tree` per device group in `groups` (this process's devices, `tp` each), each leaf a
    `NamedSharding(Layout(tp).make_mesh(group), spec)` with its spec from `specs` (a PartitionSpec tree)."""
    if any(len(g) != tp for g in groups):
        raise ValueError(f"every group must have tp={tp} devices: {[len(g) for g in groups]}")
    meshes = [Layout(tp=tp).make_mesh(list(g)) for g in groups]
    leaves, treedef = jax.tree.flatten(tree)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    if len(spec_leaves) != len(leaves):
        raise ValueError(f"specs tree has {len(spec_leaves)} leaves, the tree {len(leaves)}")
    source = set(leaves[0].sharding.device_set) if leaves else set(jax.devices())
    if source != set(jax.devices()):
        return _via_source_rows(leaves, treedef, spec_leaves, meshes, tp, source)
    mirror = mirror_mesh(tp)
    rows = {tuple(r) for r in mirror.devices.reshape(-1, tp).tolist()}
    if any(tuple(g) not in rows for g in groups):
        raise ValueError(f"groups {[[d.id for d in g] for g in groups]} are not rows of the mirror mesh "
                         "(contiguous blocks of tp devices in reuse.tp_groups order)")
    out: list[list] = [[] for _ in groups]
    for x, spec in zip(leaves, spec_leaves):
        m = jax.device_put(x, NamedSharding(mirror, spec))
        by_device = {s.device: s.data for s in m.addressable_shards}
        for copies, mesh in zip(out, meshes):
            sh = NamedSharding(mesh, spec)
            copies.append(jax.make_array_from_single_device_arrays(
                x.shape, sh, [by_device[d] for d in sh.addressable_devices_indices_map(x.shape)]))
    return [jax.tree.unflatten(treedef, c) for c in out]


def _via_source_rows(leaves, treedef, spec_leaves, meshes, tp: int, source: set) -> list[Any]:
    """The source lives on a subset of the devices: mirror over the source's devices, then a local move."""
    mine = sorted((d for d in source if d.process_index == jax.process_index()), key=lambda d: d.id)
    counts = {p: sum(d.process_index == p for d in source) for p in {d.process_index for d in source}}
    row = tp if all(n % tp == 0 for n in counts.values()) else 1
    if not mine:
        raise ValueError(f"process {jax.process_index()} holds none of the source devices")
    mirror = mirror_mesh(row, sorted(source, key=lambda d: d.id))
    row_mesh = Layout(tp=row).make_mesh(mine[:row])
    out: list[list] = [[] for _ in meshes]
    for x, spec in zip(leaves, spec_leaves):
        if set(x.sharding.device_set) != source:
            raise ValueError("every leaf must live on the same devices")
        row_spec = spec if row == tp else PartitionSpec()
        m = jax.device_put(x, NamedSharding(mirror, row_spec))
        by_device = {s.device: s.data for s in m.addressable_shards}
        sh = NamedSharding(row_mesh, row_spec)
        local = jax.make_array_from_single_device_arrays(
            x.shape, sh, [by_device[d] for d in sh.addressable_devices_indices_map(x.shape)])
        for copies, mesh in zip(out, meshes):
            copies.append(jax.device_put(local, NamedSharding(mesh, spec)))
    return [jax.tree.unflatten(treedef, c) for c in out]
