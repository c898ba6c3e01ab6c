"""Layer-wise resharding of a weight (or KV) tree between layouts and meshes, with a byte-count cost model.

`reshard(tree, target_shardings)` moves every leaf to its target sharding and returns a `ReshardReport`.
Source and target may be on different device sets: the training mesh on 8 devices -> one rollout instance on
devices 0..1, or -> each of four instances in turn (call `reshard` once per instance, `donate=False`).

**Stacked leaves move one layer at a time.** Leaves whose path the `stacked` predicate accepts (default: the
`layers.*` subtree of `models.Weights`, stacked on a leading `layers` axis) are moved as: allocate the target
leaf (zeros, already in its target sharding), then for each layer l: slice layer l on the source devices (a
jitted dynamic index whose output keeps the source sharding of the remaining dims, so no communication),
`jax.device_put` that one layer to the target's one-layer sharding, and write it into the target with a jitted
`dynamic_update_index_in_dim` that donates the target buffer (in place). The transient memory beyond source +
result is therefore about one layer of one leaf on each side (`ReshardReport.max_step_bytes`), instead of a
second copy of a whole `[L, ...]` leaf as a single `device_put` may need. With `donate=True` each source
leaf is deleted as soon as it has been moved, so peak total memory is about weights + one leaf, not 2x weights.
(The source leaf cannot be freed layer by layer: it is one buffer per device.) The per-layer path needs the
`layers` dimension unsharded on both sides and `NamedSharding`s; otherwise that leaf is moved whole (the
project's rules never shard `layers`, so this is a fallback, not a path in use). `whole_leaf_bytes=N` moves a
stacked leaf of at most N bytes whole too: its transient is then at most N bytes, and a small model's leaves
(the tests' tiny ones) skip the per-layer programs (one take and one put per target sharding and shape, each
traced and compiled for every instance's devices: ~3 s of a cold 2-step 8-instance tiny train run's ~20 CPU-s).

Other leaves (embedding, final norm, LM head) move with one `jax.device_put`. A leaf whose source sharding is
already equivalent to the target (same device -> index map) is relabelled with the target sharding without a copy
and costs nothing; with `donate=True` such a leaf's output aliases its input.

**Bytes moved** (`reshard_bytes`, also filled into the report): for every target shard on every target device,
the bytes of that shard that the *same device* did not already hold in the source sharding (overlap of the
index boxes of `Sharding.devices_indices_map`). It counts what must arrive over links, whatever collective
XLA picks; a replicated target counts once per device that lacks the data. PAT's switch-cost model uses it.

Not done here (yet): the executable cache keyed by layout (ARCHITECTURE.md) and multi-process resharding
(cross-host `device_put` between disjoint meshes); this module is exercised on one process with fake devices.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from .rules import path_str


@dataclasses.dataclass(frozen=True)
class ReshardReport:
    """What one `reshard` call did.

    bytes_moved: bytes target devices received that they did not hold before (see module docstring).
    total_bytes: logical bytes of all leaves (sum of `nbytes`, each array counted once).
    leaves: number of (non-None) leaves; leaves_moved of them actually moved (the rest were already in place).
    layer_steps: number of one-layer transfers (stacked leaves moved x their number of layers).
    max_step_bytes: logical bytes of the largest single transfer (one layer of a stacked leaf, or a whole
        other leaf): the transient memory bound of the layer-wise path.
    seconds: wall time, including waiting for the last transfer.
    bytes_by_leaf: bytes_moved per leaf path (`layers.wq` ...).
    """

    bytes_moved: int
    total_bytes: int
    leaves: int
    leaves_moved: int
    layer_steps: int
    max_step_bytes: int
    seconds: float
    bytes_by_leaf: dict[str, int]


def is_layer_path(path: str) -> bool:
    """Default `stacked` predicate: leaves of the `layers` subtree (`models.Weights.layers`)."""
    return path == "layers" or path.startswith("layers.")


def _box(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A `devices_indices_map` entry (tuple of slices) as (start, stop) pairs over the full rank."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    box = []
    for sl, n in zip(index, shape):
        start, stop, step = sl.indices(n)
        if step != 1:
            raise ValueError(f"strided shard index {sl} not supported")
        box.append((start, max(start, stop)))
    return tuple(box)


def _volume(box) -> int:
    return math.prod(stop - start for start, stop in box)


def _overlap(a, b) -> int:
    return math.prod(max(0, min(a1, b1) - max(a0, b0)) for (a0, a1), (b0, b1) in zip(a, b))


def leaf_bytes_moved(shape: tuple[int, ...], dtype, src: Sharding, dst: Sharding) -> int:
    """Bytes the devices of `dst` must receive to hold their `dst` shards, given what they hold under `src`."""
    shape = tuple(shape)
    itemsize = np.dtype(dtype).itemsize
    src_map = src.devices_indices_map(shape)
    moved = 0
    for device, index in dst.devices_indices_map(shape).items():
        box = _box(index, shape)
        held = _overlap(box, _box(src_map[device], shape)) if device in src_map else 0
        moved += (_volume(box) - held) * itemsize
    return moved


def _flatten(tree):
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [(path_str(p), x) for p, x in flat], treedef


def _check_same_paths(a, b, what_a: str, what_b: str):
    pa, pb = [p for p, _ in a], [p for p, _ in b]
    if pa != pb:
        raise ValueError(f"{what_a} and {what_b} trees differ: only in {what_a}: {sorted(set(pa) - set(pb))}, "
                         f"only in {what_b}: {sorted(set(pb) - set(pa))}")


def reshard_bytes(abstract_tree: Any, src_shardings: Any, dst_shardings: Any) -> int:
    """Total bytes a reshard from `src_shardings` to `dst_shardings` moves, without moving anything.

    `abstract_tree` has leaves with `.shape` and `.dtype` (`jax.ShapeDtypeStruct` from `models.abstract`,
    arrays, or `ArraySpec`s); the sharding trees have the same structure. Same count as
    `ReshardReport.bytes_moved`.
    """
    leaves, _ = _flatten(abstract_tree)
    src, _ = _flatten(src_shardings)
    dst, _ = _flatten(dst_shardings)
    _check_same_paths(leaves, src, "abstract", "source shardings")
    _check_same_paths(leaves, dst, "abstract", "target shardings")
    return sum(leaf_bytes_moved(x.shape, x.dtype, s, d) for (_, x), (_, s), (_, d) in zip(leaves, src, dst))


def _layer_sharding(sharding: Sharding, ndim: int) -> NamedSharding | None:
    """The sharding of one layer `x[l]` of a stacked leaf, or None if `layers` is sharded / not a NamedSharding."""
    if not isinstance(sharding, NamedSharding):
        return None
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    if spec[0] is not None:
        return None
    return NamedSharding(sharding.mesh, PartitionSpec(*spec[1:]), memory_kind=sharding.memory_kind)


# One compiled program per (shape, dtype, sharding), reused across layers, leaves of equal shape and calls.
@functools.lru_cache(maxsize=512)
def _zeros_fn(shape, dtype, sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.lru_cache(maxsize=512)
def _take_layer_fn(layer_sharding):
    return jax.jit(lambda x, i: lax.dynamic_index_in_dim(x, i, 0, keepdims=False), out_shardings=layer_sharding)


@functools.lru_cache(maxsize=512)
def _put_layer_fn(sharding):
    return jax.jit(lambda out, layer, i: lax.dynamic_update_index_in_dim(out, layer, i, 0),
                   out_shardings=sharding, donate_argnums=0)


def _move_stacked(x: jax.Array, dst: Sharding, src_layer: NamedSharding, dst_layer: NamedSharding,
                  progress: Callable[[], None] | None = None) -> jax.Array:
    out = _zeros_fn(x.shape, x.dtype, dst)()
    take, put = _take_layer_fn(src_layer), _put_layer_fn(dst)
    for l in range(x.shape[0]):
        i = np.int32(l)
        layer = jax.device_put(take(x, i), dst_layer)
        out = put(out, layer, i)
        if progress is not None:
            progress()
    return out


def reshard(weights: Any, target_shardings: Any, *, donate: bool | Callable[[jax.Array], bool] = False,
            stacked: Callable[[str], bool] = is_layer_path, whole_leaf_bytes: int = 0,
            progress: Callable[[], None] | None = None) -> tuple[Any, ReshardReport]:
    """Move every leaf of `weights` (a pytree of `jax.Array`) to the matching leaf of `target_shardings`.

    Values are exact (copies, no arithmetic). `stacked(path)` says which leaves are stacked on a leading layer
    axis and move one layer at a time (default: the `layers.*` subtree; pass `lambda p: True` for a KV cache
    `[layers, ...]`). With `donate=True` the source arrays are consumed (deleted once moved); `donate` may also
    be a predicate on each source leaf (only the leaves it accepts are consumed). A stacked leaf of at most
    `whole_leaf_bytes` moves whole, like the other leaves (default 0: every stacked leaf layer by layer).
    `progress()`, if given, is called after every layer step and every moved leaf (memory probes, progress bars).
    """
    start = time.perf_counter()
    src, treedef = _flatten(weights)
    dst, _ = _flatten(target_shardings)
    _check_same_paths(src, dst, "weights", "target shardings")
    out, by_leaf = [], {}
    moved_leaves = layer_steps = max_step = total = 0
    for (path, x), (_, target) in zip(src, dst):
        if not isinstance(target, Sharding):
            raise TypeError(f"{path}: expected a jax.sharding.Sharding target, got {type(target).__name__}")
        if isinstance(x, np.ndarray):
            # A host copy (e.g. gathered from a multi-process array): each target device receives only its
            # own slice; every byte crosses host->device, so all of it counts as moved.
            total += x.nbytes
            moved_leaves += 1
            by_leaf[path] = x.nbytes
            max_step = max(max_step, x.nbytes)
            out.append(jax.device_put(x, target))
            continue
        if not isinstance(x, jax.Array):
            raise TypeError(f"{path}: expected a jax.Array or numpy array, got {type(x).__name__}")
        total += x.nbytes
        if x.sharding.is_equivalent_to(target, x.ndim):
            # Same devices, same shards (e.g. replicated on the same devices of another mesh): relabel only;
            # device_put of an equivalent sharding aliases the buffers, nothing is copied.
            out.append(x if x.sharding == target else jax.device_put(x, target))
            by_leaf[path] = 0
            continue
        moved_leaves += 1
        src_layer = dst_layer = None
        if stacked(path) and x.ndim >= 1 and x.shape[0] > 0 and x.nbytes > whole_leaf_bytes:
            src_layer, dst_layer = _layer_sharding(x.sharding, x.ndim), _layer_sharding(target, x.ndim)
        if src_layer is not None and dst_layer is not None:
            # Count per step, so the report is the sum over what was actually sent, layer by layer.
            moved = x.shape[0] * leaf_bytes_moved(x.shape[1:], x.dtype, src_layer, dst_layer)
            new = _move_stacked(x, target, src_layer, dst_layer, progress)
            layer_steps += x.shape[0]
            max_step = max(max_step, x.nbytes // x.shape[0])
            if donate is True or (callable(donate) and donate(x)):
                x.delete()
        else:
            moved = leaf_bytes_moved(x.shape, x.dtype, x.sharding, target)
            # may_alias=False: the result never shares a buffer with `x`, so deleting `x` is safe. (device_put's
            # own `donate` is only a hint: it leaves `x` alive where it cannot reuse the buffer.)
            new = jax.device_put(x, target, may_alias=False)
            max_step = max(max_step, x.nbytes)
            if donate is True or (callable(donate) and donate(x)):
                x.delete()
        by_leaf[path] = moved
        out.append(new)
        if progress is not None:
            progress()
    out = jax.block_until_ready(out)
    report = ReshardReport(bytes_moved=sum(by_leaf.values()), total_bytes=total, leaves=len(src),
                           leaves_moved=moved_leaves, layer_steps=layer_steps, max_step_bytes=max_step,
                           seconds=time.perf_counter() - start, bytes_by_leaf=by_leaf)
    return jax.tree_util.tree_unflatten(treedef, out), report
