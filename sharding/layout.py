"""`Layout`: how many ways a device group is split for data, FSDP and tensor parallelism, and the `Mesh` it builds.

A layout is only sizes; it becomes a `jax.sharding.Mesh` once it is given a concrete device list, so the same
`Layout(tp=2)` can build four disjoint rollout instances from `split_devices(devices, 4)` (one sub-mesh each,
see ARCHITECTURE.md: "a rollout instance is one TP group on its own sub-mesh").

Decisions:
- The mesh always has the three axes `("dp", "fsdp", "tp")`, size-1 axes included. Sharding rules can then name
  `fsdp` or `tp` without caring whether that axis is trivial in a given layout, and every mesh of the project
  has the same axis names (one fewer thing for the executable cache key to vary on).
- `tp` is the last (fastest-varying) mesh axis, so a TP group is a run of *adjacent* devices of the given list.
  On GPUs the device list is in NVLink/host order, which puts the communication-heaviest axis (tensor
  parallelism: an all-reduce per layer) on the fastest links; `dp` (no communication in the forward) is outermost.
- Axis types are `AxisType.Auto`: sharding propagation decides intermediate shardings; the project annotates
  weights and inputs explicitly (see `sharding.rules`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from jax.sharding import AxisType, Mesh

MESH_AXES = ("dp", "fsdp", "tp")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Sizes of the `dp`, `fsdp` and `tp` mesh axes; `size` devices in all."""

    dp: int = 1
    fsdp: int = 1
    tp: int = 1

    def __post_init__(self):
        for name in MESH_AXES:
            value = getattr(self, name)
            # bool is an int subclass: Layout(tp=True) is a bug, not tp=1.
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Layout.{name}={value!r} must be a positive int")

    @property
    def size(self) -> int:
        """Number of devices the layout needs."""
        return self.dp * self.fsdp * self.tp

    @property
    def mesh_shape(self) -> dict[str, int]:
        """Mesh axis name -> size, in mesh order (the `mesh_shape` argument of `sharding.specs_for`)."""
        return {name: int(getattr(self, name)) for name in MESH_AXES}

    @property
    def name(self) -> str:
        """Short stable name, e.g. `dp1-fsdp4-tp2` (file names, cache keys, logs)."""
        return "-".join(f"{axis}{size}" for axis, size in self.mesh_shape.items())

    def make_mesh(self, devices: Sequence) -> Mesh:
        """A `Mesh` with axes `("dp", "fsdp", "tp")` over exactly `devices`, in the given order (tp fastest)."""
        devices = list(devices)
        if len(devices) != self.size:
            raise ValueError(f"{self} needs dp*fsdp*tp = {self.dp}*{self.fsdp}*{self.tp} = {self.size} devices, "
                             f"got {len(devices)}")
        if len(set(devices)) != len(devices):
            raise ValueError(f"device list for {self} has duplicates: {devices}")
        grid = np.empty(len(devices), dtype=object)
        grid[:] = devices  # not np.array(devices): that would try to iterate Device objects
        return Mesh(grid.reshape(self.dp, self.fsdp, self.tp), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def split_devices(devices: Sequence, n: int) -> list[list]:
    """Split `devices` into `n` disjoint, contiguous, equal-sized groups (one per rollout instance).

    Contiguous groups keep each instance on neighbouring devices (same NVLink domain / host on GPUs), for the same
    reason `tp` is the fastest mesh axis. Example: 8 devices, n=4 -> four groups of 2 for four `Layout(tp=2)`
    instances; n=1 -> the whole list for one `Layout(tp=8)` instance.
    """
    devices = list(devices)
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n <= 0:
        raise ValueError(f"n={n!r} must be a positive int")
    if len(set(devices)) != len(devices):
        raise ValueError(f"device list has duplicates: {devices}")
    if len(devices) % n:
        raise ValueError(f"cannot split {len(devices)} devices into {n} equal groups")
    k = len(devices) // n
    return [devices[i * k:(i + 1) * k] for i in range(n)]
