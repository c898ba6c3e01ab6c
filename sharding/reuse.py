"""Resharding that reuses the shards devices already hold, and the device order that makes it free.

PAT switches TP mid-generation (TP2x4 -> TP8x1): the weights do not change, only their partitioning. The
paper reshards explicitly (all-gather + slice) because its engine fixes the rank-to-shard mapping (§4.3).
A JAX mesh carries its own device order, so we pick the order instead.

**Nested device order** (`nested_order`). A block of 2^k devices is ordered recursively as the interleave of
its two halves' orders: 2 -> [0, 1], 4 -> [0, 2, 1, 3], 8 -> [0, 4, 2, 6, 1, 5, 3, 7] (bit reversal).
`tp_groups(devices, tp)` gives TP groups as contiguous blocks of `tp` devices, each in nested order. Then a
device at rank t of a TP-n group holds the t-th 1/n of every tp-sharded dimension, and after merging two
such groups into a TP-2n group it sits at rank 2t or 2t+1, whose 1/2n lies inside what it holds: every merge
of power-of-two TP groups (TP n -> TP m, m > n, any number of steps) needs **no weight bytes to move**,
only local slices. A contiguous order (rank t = t-th device of the block) moves about half of every
merged group's tp-sharded weights (device 1 of [0, 1] holds the second half, but is rank 1 of 4 in
[0, 1, 2, 3] and needs the second quarter). Splits (m < n) must move what each device lacks; the order
changes nothing there. Blocks whose size is not a power of two keep the contiguous order.

**Reusing reshard** (`reshard_reusing(replicas, targets)`). The old layout's instances hold the same
weights (replicas) on different devices. For every leaf and every target device: when a shard the device
already holds (of any replica) contains the target box, the new shard is a local slice (nothing crosses
a link); else, when some other device's shard contains it, that device slices it and sends only the box;
else (the box spans several source shards: a split) the leaf moves by `jax.device_put` from replica 0.
Leaves go one at a time across all targets, and each old leaf that `consumed` accepts is freed as soon as
every target has its copy, so the transient is one leaf's new copies. Values are exact (slices and copies).
`reuse_bytes_moved` counts the bytes that cross links (a target box minus the largest part of it one local
shard holds), the same measure as `reshard.leaf_bytes_moved` with every replica as a source.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.sharding import Sharding

from .reshard import ReshardReport, _box, _check_same_paths, _flatten, _overlap, _volume


# ------------------------------------------------------------------------------------------ device order
def nested_order(devices: Sequence) -> list:
    """The nested (bit-reversed) order of a block of devices; blocks not of size 2^k keep their order."""
    devs = list(devices)
    n = len(devs)
    if n <= 2 or n & (n - 1):
        return devs
    a, b = nested_order(devs[: n // 2]), nested_order(devs[n // 2:])
    return [d for pair in zip(a, b) for d in pair]


def tp_groups(devices: Sequence, tps: Sequence[int]) -> list[list]:
    """Device groups of instances with TP sizes `tps`: contiguous blocks from the start of `devices`, each
    in `nested_order` (so merges and splits between power-of-two layouts reuse the shards held)."""
    devs, out, at = list(devices), [], 0
    for tp in tps:
        out.append(nested_order(devs[at:at + tp]))
        at += tp
    return out


# ------------------------------------------------------------------------------------------ byte count
def _contains(outer, inner) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner))


def _held(shape, sources: Sequence[Sharding]) -> dict:
    """device -> the index boxes it holds under any of `sources`."""
    held: dict = {}
    for s in sources:
        for d, idx in s.devices_indices_map(tuple(shape)).items():
            held.setdefault(d, []).append(_box(idx, tuple(shape)))
    return held


def reuse_bytes_moved(shape, dtype, sources: Sequence[Sharding], dst: Sharding) -> int:
    """Bytes the devices of `dst` must receive, given what each holds under any of `sources` (replicas)."""
    shape, item = tuple(shape), np.dtype(dtype).itemsize
    held = _held(shape, sources)
    moved = 0
    for d, idx in dst.devices_indices_map(shape).items():
        box = _box(idx, shape)
        have = max((_overlap(box, h) for h in held.get(d, ())), default=0)
        moved += (_volume(box) - have) * item
    return moved


def tree_reuse_bytes(abstract_tree: Any, sources: Sequence[Any], dst_shardings: Any) -> int:
    """`reuse_bytes_moved` summed over a tree: `sources` is a list of sharding trees (one per replica)."""
    leaves, _ = _flatten(abstract_tree)
    dst, _ = _flatten(dst_shardings)
    srcs = [_flatten(s)[0] for s in sources]
    _check_same_paths(leaves, dst, "abstract", "target shardings")
    return sum(reuse_bytes_moved(x.shape, x.dtype, [s[i][1] for s in srcs], d)
               for i, ((_, x), (_, d)) in enumerate(zip(leaves, dst)))


# ------------------------------------------------------------------------------------------ the reshard
@functools.lru_cache(maxsize=1024)
def _slice_fn(sizes: tuple[int, ...]):
    return jax.jit(lambda x, *starts: lax.dynamic_slice(x, starts, sizes))


def _piece(data: jax.Array, src_box, box) -> jax.Array:
    """The part `box` of a single-device array holding `src_box`, as a fresh buffer on the same device."""
    starts = [np.int32(b0 - s0) for (b0, _), (s0, _) in zip(box, src_box)]
    return _slice_fn(tuple(b1 - b0 for b0, b1 in box))(data, *starts)


def _reuse_leaf(xs: list[jax.Array], dst: Sharding) -> tuple[jax.Array, int] | None:
    """The leaf on `dst` built from local (else remote) slices of the replicas' shards; None when some target
    box lies in no single source shard. Returns (array, bytes sent over links)."""
    shape = xs[0].shape
    shards = [(s.device, _box(s.index, shape), s.data) for x in xs for s in x.addressable_shards]
    pieces, sent = [], 0
    for d, idx in dst.addressable_devices_indices_map(shape).items():
        box = _box(idx, shape)
        local = next((s for s in shards if s[0] == d and _contains(s[1], box)), None)
        src = local or next((s for s in shards if _contains(s[1], box)), None)
        if src is None:
            return None
        p = _piece(src[2], src[1], box)
        if local is None:
            p = jax.device_put(p, d)
            sent += _volume(box) * xs[0].dtype.itemsize
        pieces.append(p)
    return jax.make_array_from_single_device_arrays(shape, dst, pieces), sent


def reshard_reusing(replicas: Sequence[Any], targets: Sequence[Any], *,
                    consumed: Callable[[jax.Array], bool] = lambda x: False,
                    progress: Callable[[], None] | None = None) -> tuple[list[Any], ReshardReport]:
    """One copy of the weights per sharding tree in `targets`, built from `replicas` (trees of equal values
    and shapes on different devices), reusing what each target device already holds (module docstring).
    Every replica leaf `consumed` accepts is deleted once all targets have that leaf."""
    start = time.perf_counter()
    reps = [_flatten(r)[0] for r in replicas]
    treedef = _flatten(replicas[0])[1]
    dsts = [_flatten(t)[0] for t in targets]
    for r in reps[1:]:
        _check_same_paths(reps[0], r, "replica 0", "another replica")
    for t in dsts:
        _check_same_paths(reps[0], t, "weights", "target shardings")
    outs: list[list] = [[] for _ in targets]
    by_leaf, total, moved_leaves, max_step = {}, 0, 0, 0
    for i, (path, x0) in enumerate(reps[0]):
        xs = [r[i][1] for r in reps]
        if any(x.shape != x0.shape or x.dtype != x0.dtype for x in xs):
            raise ValueError(f"{path}: replicas differ in shape or dtype")
        sent = 0
        for out, dst in zip(outs, dsts):
            target = dst[i][1]
            got = _reuse_leaf(xs, target)
            if got is None:        # a split: the box spans source shards; move from replica 0
                sent_j = reuse_bytes_moved(x0.shape, x0.dtype, [x.sharding for x in xs], target)
                got = (jax.device_put(x0, target, may_alias=False), sent_j)
            out.append(got[0])
            sent += got[1]
            total += x0.nbytes
        max_step = max(max_step, x0.nbytes)
        moved_leaves += bool(sent)
        by_leaf[path] = sent
        jax.block_until_ready([o[-1] for o in outs])
        for x in xs:
            if not x.is_deleted() and consumed(x):
                x.delete()
        if progress is not None:
            progress()
    report = ReshardReport(bytes_moved=sum(by_leaf.values()), total_bytes=total, leaves=len(reps[0]),
                           leaves_moved=moved_leaves, layer_steps=0, max_step_bytes=max_step,
                           seconds=time.perf_counter() - start, bytes_by_leaf=by_leaf)
    return [jax.tree_util.tree_unflatten(treedef, o) for o in outs], report
