"""DistFlow's distributed databuffer (§6.2, Fig. 7-8): samples move between stages whose data-parallel
layouts differ by resharding global arrays on the devices, never through process 0.

A layout is `groups` data-parallel groups over one ordered device list (group g = the g-th contiguous
slice; with one group per process, a process's own devices). The source stage's samples are rows of
global arrays sharded over its groups (each group supplies only its own rows); a plan says which
destination group takes which samples; one jitted gather whose output is sharded over the destination
groups moves them (XLA's collectives: an all-to-all across processes), and each group reads back only
its own rows. When every sample stays in its group (same DP size and plan) nothing moves: the fast path.

Plans (every process computes the same one from the gathered lengths, which are metadata, not samples):

* `plan_contiguous(counts, n_dst)`: the global order cut into n_dst near-equal contiguous parts (DistFlow's
  repartition when the DP size changes: 2 -> 4, 4 -> 2, uneven sources); the order is preserved.
* `plan_tokens(lengths, n_dst, home)`: token-balanced, each group's samples in global order; from a current
  placement (`home`) with as few moves as it takes, else LPT. The process holding the long tail no longer
  decides everyone's row count: `padding` measures the packed batch's padding fraction before and after.

Bytes are counted from the plan: a sample's row bytes count as moved when its destination group differs
from its source group; `into_first` counts what lands on group 0 (process 0 with one group per process).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl.train.batch import Sample, pack_rows
from jaxrl.train.distributed import allgather, gather_ragged


def plan_contiguous(counts: Sequence[int], n_dst: int) -> list[list[int]]:
    """Destination group -> global sample indices: the global order (source groups' samples one after the
    other) cut into `n_dst` contiguous parts whose sizes differ by at most one."""
    n = int(sum(counts))
    bounds = [n * q // n_dst for q in range(n_dst + 1)]
    return [list(range(bounds[q], bounds[q + 1])) for q in range(n_dst)]


def plan_tokens(lengths: Sequence[int], n_dst: int, home: Sequence[int] | None = None,
                tolerance: int = 0) -> list[list[int]]:
    """Destination group -> global sample indices, token-balanced, each group's indices in global order.

    Without `home`: longest first onto the group with the fewest tokens (LPT; ties to the lower group).
    With `home` (each sample's current group, n_dst groups): as few moves as it takes. While the gap
    between the most- and the least-loaded group exceeds `tolerance` tokens (the trainer: one packed row)
    and some sample of the most-loaded group is shorter than the gap, the longest such sample moves to
    the least-loaded one (each move lowers the sum of squared loads, so it ends); a batch already
    balanced within the tolerance moves nothing."""
    if home is None:
        load = [0] * n_dst
        out: list[list[int]] = [[] for _ in range(n_dst)]
        for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
            q = min(range(n_dst), key=lambda q: (load[q], q))
            out[q].append(i)
            load[q] += int(lengths[i])
        return [sorted(x) for x in out]
    where = [int(h) for h in home]
    load = [0] * n_dst
    for i, g in enumerate(where):
        load[g] += int(lengths[i])
    for _ in range(len(lengths)):
        hi = max(range(n_dst), key=lambda q: (load[q], -q))
        lo = min(range(n_dst), key=lambda q: (load[q], q))
        gap = load[hi] - load[lo]
        if gap <= tolerance:
            break
        movable = [i for i, g in enumerate(where) if g == hi and 0 < lengths[i] < gap]
        if not movable:
            break
        i = max(movable, key=lambda i: (lengths[i], -i))
        where[i] = lo
        load[hi] -= int(lengths[i])
        load[lo] += int(lengths[i])
    return [[i for i, g in enumerate(where) if g == q] for q in range(n_dst)]


def sources(counts: Sequence[int]) -> np.ndarray:
    """Global sample index -> its source group."""
    return np.repeat(np.arange(len(counts)), counts)


def is_identity(counts: Sequence[int], plan: list[list[int]]) -> bool:
    """Every sample stays in its group and keeps its place: nothing to move."""
    if len(plan) != len(counts):
        return False
    start = np.concatenate([[0], np.cumsum(counts)])
    return all(list(p) == list(range(start[g], start[g + 1])) for g, p in enumerate(plan))


def padding(lengths_by_group: Sequence[Sequence[int]], pack_len: int) -> float:
    """Padding fraction of a packed batch: every group packs its sequences into rows of `pack_len`
    (first-fit decreasing) and all groups use the largest group's row count (one global array)."""
    rows = max((len(pack_rows(list(ls), pack_len)) for ls in lengths_by_group), default=0)
    tokens = sum(int(x) for ls in lengths_by_group for x in ls)
    total = rows * len(lengths_by_group) * pack_len
    return 1.0 - tokens / total if total else 0.0


@dataclasses.dataclass
class Moved:
    rows: dict[int, dict[str, np.ndarray]]     # destination group (held here) -> field -> its rows
    bytes_moved: int                           # row bytes whose group changed, over all groups
    bytes_into_first: int                      # of which landed on group 0 (process 0)


class Databuffer:
    """Moves rows from `src_groups` to `dst_groups` groups over `devices` (ordered; group g = the g-th
    slice). One jitted gather per (field shape, sizes); executables are cached by JAX."""

    def __init__(self, devices: Sequence, src_groups: int, dst_groups: int):
        devices = list(devices)
        for g in (src_groups, dst_groups):
            if len(devices) % g:
                raise ValueError(f"{len(devices)} devices do not split into {g} groups")
        self.devices, self.src_groups, self.dst_groups = devices, src_groups, dst_groups
        self.src = NamedSharding(Mesh(np.array(devices).reshape(src_groups, -1), ("g", "r")), P("g"))
        self.dst = NamedSharding(Mesh(np.array(devices).reshape(dst_groups, -1), ("g", "r")), P("g"))
        self.idx = NamedSharding(self.dst.mesh, P())
        self._gather = jax.jit(lambda x, i: jnp.take(x, i, axis=0, mode="fill", fill_value=0),
                               out_shardings=self.dst)

    def local_groups(self, sharding) -> list[int]:
        """The groups of `sharding` whose devices this process holds."""
        mesh = sharding.mesh
        return sorted({g for g in range(mesh.shape["g"]) for d in mesh.devices[g]
                       if d.process_index == jax.process_index()})

    def move(self, fields: dict[str, dict[int, np.ndarray]], counts: Sequence[int],
             plan: list[list[int]]) -> Moved:
        """`fields[name][g]`: source group g's rows (for the groups held here; any length >= counts[g],
        the rest padding); `counts[g]`: its samples (every group's, the same on every process); `plan`:
        destination group -> global sample indices (in the order it wants them)."""
        counts = [int(c) for c in counts]
        if len(counts) != self.src_groups or len(plan) != self.dst_groups:
            raise ValueError(f"{len(counts)} source counts / {len(plan)} plan groups for a {self.src_groups} -> "
                             f"{self.dst_groups} databuffer")
        got = sorted(i for p in plan for i in p)
        if got != list(range(sum(counts))):
            raise ValueError("the plan must take every sample exactly once")
        start = np.concatenate([[0], np.cumsum(counts)]).astype(int)
        n_src, n_dst = max(max(counts), 1), max(max(len(p) for p in plan), 1)
        src_of = sources(counts)
        index = np.full((self.dst_groups, n_dst), -1, np.int64)
        for q, p in enumerate(plan):                   # global sample -> its row in the source array
            index[q, :len(p)] = [src_of[i] * n_src + (i - start[src_of[i]]) for i in p]
        idx = jax.device_put(index.reshape(-1).astype(np.int32), self.idx)
        out: dict[int, dict[str, np.ndarray]] = {q: {} for q in self.local_groups(self.dst)}
        row_bytes = 0
        for name, by_group in fields.items():
            sample = next(iter(by_group.values()))
            tail, dtype = sample.shape[1:], sample.dtype
            row_bytes += int(np.prod(tail, dtype=np.int64)) * np.dtype(dtype).itemsize

            def piece(index_, by_group=by_group, tail=tail, dtype=dtype):
                g = index_[0].start // n_src if index_[0].start is not None else 0
                rows = np.zeros((n_src, *tail), dtype)
                rows[:counts[g]] = by_group[g][:counts[g]]
                return rows

            x = jax.make_array_from_callback((self.src_groups * n_src, *tail), self.src, piece)
            y = self._gather(x, idx)
            for shard in y.addressable_shards:
                q = (shard.index[0].start or 0) // n_dst
                if name not in out[q]:
                    out[q][name] = np.asarray(shard.data)[:len(plan[q])]
        dst_of = np.empty(len(src_of), np.int64)
        for q, p in enumerate(plan):
            dst_of[p] = q
        changed = dst_of != src_of
        return Moved(out, int(changed.sum()) * row_bytes, int((changed & (dst_of == 0)).sum()) * row_bytes)


class SampleBuffer:
    """The trainer's databuffer between the rollout (each process's own samples) and the update's packed
    rows: `repartition(samples)` balances tokens over the processes (`trainer.repartition=tokens`) when
    that packs the batch into fewer rows, else moves nothing. Returns this process's samples and the
    metrics flow/padding_local, flow/padding_balanced (after; = local when nothing moved),
    flow/bytes_moved and flow/proc0_sample_bytes."""

    def __init__(self, mesh, pack_len: int):
        devices = sorted(mesh.devices.flat, key=lambda d: (d.process_index, d.id))
        self.n = jax.process_count()
        self.pack_len = pack_len
        self.buffer = Databuffer(devices, self.n, self.n)

    def repartition(self, samples: list[Sample]) -> tuple[list[Sample], dict]:
        lens = [len(s.prompt) + len(s.response) for s in samples]
        counts = [int(c) for c in allgather(np.asarray([len(samples)], np.int64))[:, 0]]
        every = [int(x) for x in gather_ragged(np.asarray(lens, np.int64))]
        start = np.concatenate([[0], np.cumsum(counts)]).astype(int)
        by_proc = [every[start[g]:start[g + 1]] for g in range(self.n)]
        home = sources(counts)
        stay = [list(range(start[g], start[g + 1])) for g in range(self.n)]
        before = padding(by_proc, self.pack_len)

        def cost(plan):          # (padding, samples moved): the fewest rows, then the fewest moves
            moves = sum(home[i] != q for q, idx in enumerate(plan) for i in idx)
            return padding([[every[i] for i in p] for p in plan], self.pack_len), moves

        # balanced to within one packed row (few moves), or as far as single moves go; kept only if it
        # packs the batch into fewer rows
        plan = min([stay] + [plan_tokens(every, self.n, home=home, tolerance=t) for t in (self.pack_len, 0)],
                   key=cost)
        after = cost(plan)[0]
        metrics = {"flow/padding_local": before, "flow/padding_balanced": after}
        if is_identity(counts, plan):        # the fast path: nothing moves
            metrics.update({"flow/bytes_moved": 0, "flow/proc0_sample_bytes": 0})
            return samples, metrics
        me = jax.process_index()
        moved = self.buffer.move(encode(samples, self.pack_len, me), counts, plan)
        metrics.update({"flow/bytes_moved": moved.bytes_moved, "flow/proc0_sample_bytes": moved.bytes_into_first})
        return decode(moved.rows[me]), metrics


def encode(samples: list[Sample], width: int, group: int) -> dict[str, dict[int, np.ndarray]]:
    """Samples as fixed-width rows: tokens (prompt + response), per-token advantages, behaviour log-probs and
    loss mask (multi-turn; ones when none), and (prompt length, response length, version, has log-probs +
    2 x has a mask)."""
    n = max(len(samples), 1)
    tokens = np.zeros((n, width), np.int32)
    mask = np.zeros((n, width), np.int32)
    adv = np.zeros((n, width), np.float32)
    logp = np.zeros((n, width), np.float32)
    meta = np.zeros((n, 4), np.int32)
    for i, s in enumerate(samples):
        p, r = len(s.prompt), len(s.response)
        tokens[i, :p + r] = list(s.prompt) + list(s.response)
        adv[i, :r] = np.broadcast_to(np.asarray(s.advantage, np.float32), (r,))
        if s.logprobs is not None:
            logp[i, :r] = s.logprobs
        mask[i, :r] = 1 if s.mask is None else s.mask
        meta[i] = (p, r, s.version, (s.logprobs is not None) + 2 * (s.mask is not None))
    return {"tokens": {group: tokens}, "adv": {group: adv}, "logp": {group: logp}, "mask": {group: mask},
            "meta": {group: meta}}


def decode(rows: dict[str, np.ndarray]) -> list[Sample]:
    out = []
    for t, a, lp, m, (p, r, v, has) in zip(rows["tokens"], rows["adv"], rows["logp"], rows["mask"], rows["meta"]):
        out.append(Sample([int(x) for x in t[:p]], [int(x) for x in t[p:p + r]], np.asarray(a[:r]),
                          [float(x) for x in lp[:r]] if has & 1 else None, int(v),
                          mask=[int(x) for x in m[:r]] if has & 2 else None))
    return out
