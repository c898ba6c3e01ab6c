"""Moving live sequences between instances (`attach`) and switching the instance layout (`relayout`).

**attach.** Detached `SequenceState`s name the pages holding their KV in their source instance's pool.
With kv="migrate" each group of states (a GRPO group's siblings together) gets one target page per
*distinct* source page, so shared prompt pages move once and stay shared; the pages move layer by layer
(`kv_store.move_pages`); the bytes sent are reported next to the `kv_store.move_bytes` prediction. A
group whose pages do not fit the target's free pages recomputes instead (counted). kv="recompute"
drops the KV: the sequence re-prefills prompt + generated tokens. Source pages are released either way.

**relayout** (PAT's switch; any layout to any layout, uniform or not), in an order that bounds memory:
  1. pause; detach every live sequence, keeping its pages;
  2. stage the moved KV: each old pool's live pages gathered into compact [layers, n, ...] arrays on the
     old devices (this is the only copy of KV that exists twice);
  3. free the old pools;
  4. the weights. Mid-generation (no new `weights`): every new copy is cut from the old copies
     (`sharding.reshard_reusing`), leaf by leaf, each device slicing the shard it already holds where that
     contains its new one (with `plan_layout`'s nested device order, any merge to a larger power-of-two TP:
     no weight byte crosses a link), each old leaf freed once every new copy has it. Otherwise (a weight
     sync riding the relayout, or vocabularies padded differently) the redundant old copies are freed
     first and the remaining one (or the given weights) is resharded layer by layer into each new
     instance, the last copy consuming (donating) the source leaf by leaf;
  5. build the new instances (pools sized by the memory budget of their layout) and attach the states,
     groups to the least-loaded new instance (of their StreamRL class's, when `classes` are kept), their
     staged pages moved layer by layer; free the staging.
So live device memory never exceeds max(before, after) by more than the moved KV plus the transient of
the leaf being moved (one layer of a stacked leaf plus, in the last copy, the rest of the source leaf
until it is freed; or, reusing, one leaf's new copies: bounded by the new pools whenever they are at
least one leaf, as budget-sized pools are). `RelayoutReport.weight_bytes` is what crossed links;
`weight_bytes_contiguous` what the same switch would have moved with contiguous device groups. A weight array sharing a buffer with an array the caller passed in (a device_put to an equivalent
sharding aliases it) is never freed here.
Executables come from the process-wide cache, so switching back to a layout used before compiles nothing.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence as Seq

import jax

from sharding import Layout, padded_vocab_for, reshard_reusing, tp_groups, tree_reuse_bytes

from .kv_store import KVStore, move_bytes, move_pages
from .scheduler import SequenceState
from .skew import Classes, deal_units


@dataclasses.dataclass
class MoveReport:
    migrated: int = 0           # sequences that kept their KV
    recomputed: int = 0         # sequences that will re-prefill
    pages_moved: int = 0        # distinct pages copied
    kv_bytes: int = 0           # bytes the target devices received
    kv_bytes_predicted: int = 0  # `move_bytes` before moving
    seconds: float = 0.0


@dataclasses.dataclass
class RelayoutReport:
    old_layout: list[int]
    new_layout: list[int]
    sequences: int
    kv: MoveReport
    weight_bytes: int           # bytes the new instances' devices received (`ReshardReport.bytes_moved`)
    weight_bytes_contiguous: int = 0   # the same switch with contiguous device groups (no nested order)
    compiles: int = 0           # executables compiled by the switch itself (0: none; steps compile lazily)
    seconds: float = 0.0
    weight_seconds: float = 0.0  # of which the layer-wise weight reshard (to the new instances' meshes)


@dataclasses.dataclass
class PoolSource:
    """Where detached states' KV can be read: a live pool (page ids index it) or staged arrays (`rows`
    maps a page id to its index in them), and how to release the states' references."""

    kv: KVStore | tuple
    release: Callable[[list[int]], None]
    rows: dict[int, int] | None = None


def _groups(states: list[SequenceState]) -> list[list[SequenceState]]:
    """States by (source instance, sharing group), in first-seen order; a standalone state is its own group."""
    out: dict = defaultdict(list)
    for st in states:
        key = (st.instance, st.group if st.group is not None and st.pages else ("solo", st.rid))
        out[key].append(st)
    return list(out.values())


def device_move(src_kv, rows: list[int], dst_kv, dst: list[int]) -> tuple:
    """Copy pages `rows` of `src_kv` into pages `dst` of `dst_kv` on the devices: (new dst_kv, bytes sent,
    bytes predicted by `move_bytes`). `attach`'s default mover (the simulator passes one that only counts)."""
    predicted = move_bytes(len(rows), src_kv, dst_kv)
    dst_kv, sent = move_pages(src_kv, rows, dst_kv, dst)
    return dst_kv, sent, predicted


def attach(states: list[SequenceState], target, sources: dict[int, PoolSource], kv: str, *,
           mover: Callable = device_move) -> MoveReport:
    """Attach `states` to instance `target` (see module docstring); returns what moved. `mover(src kv, source
    rows, target kv, target pages) -> (target kv, bytes sent, bytes predicted)` copies the pages."""
    t0 = time.perf_counter()
    target.pause()
    rep = MoveReport()
    plan: dict[int, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
    joins: list[tuple[list[SequenceState], dict | None]] = []
    moved: list[SequenceState] = []           # source references to release once their pages are copied
    for grp in _groups(states):
        src = sources.get(grp[0].instance) if grp[0].instance is not None else None
        page_map = None
        if kv == "migrate" and src is not None and grp[0].pages:
            distinct = list(dict.fromkeys(p for st in grp for p in st.pages))
            if grp[0].instance == target.index and src.rows is None:     # back where it was: nothing moves
                page_map = {p: p for p in distinct}
            elif len(distinct) <= target.pool.available:
                dst = target.pool.alloc(len(distinct))
                page_map = dict(zip(distinct, dst))
                holders = Counter(p for st in grp for p in st.pages)   # one reference per holder, as before
                target.pool.share([page_map[p] for p, n in holders.items() for _ in range(n - 1)])
                plan[grp[0].instance][0].extend(distinct)
                plan[grp[0].instance][1].extend(dst)
                moved += grp
        if page_map is None:
            if src is not None:
                for st in grp:
                    src.release(list(st.pages))
            rep.recomputed += len(grp)
        else:
            rep.migrated += len(grp)
        joins.append((grp, page_map))
    for src_index, (pages, dst) in plan.items():
        src = sources[src_index]
        rows = [src.rows[p] for p in pages] if src.rows is not None else pages
        target.kv, sent, predicted = mover(src.kv, rows, target.kv, dst)
        rep.kv_bytes_predicted += predicted
        rep.kv_bytes += sent
        rep.pages_moved += len(pages)
    for st in moved:
        sources[st.instance].release(list(st.pages))
    for grp, page_map in joins:
        target.sched.attach(grp, page_map)
    rep.seconds = time.perf_counter() - t0
    return rep


def deal(states: list[SequenceState], n: int, classes: Classes | None = None) -> list[list[SequenceState]]:
    """Step 5's placement: `states` (request-id order) dealt to `n` new instances, a group sharing KV pages
    together, each to the instance holding the fewest context tokens so far (ties: the lower index); with
    StreamRL's `classes` (`skew.Classes` on `n` instances), among its own class's instances (`skew.deal_units`)."""
    assigned: list[list[SequenceState]] = [[] for _ in range(n)]
    units = _groups(list(states))
    is_long = [classes is not None and any(st.rid in classes.long for st in grp) for grp in units]
    for grp, j in zip(units, deal_units([(sum(st.context_len for st in g), k) for g, k in zip(units, is_long)],
                                        n, classes)):
        assigned[j] += grp
    return assigned


def attach_dealt(states: list[SequenceState], new: list, sources: dict[int, PoolSource], kv: str, *,
                 mover: Callable = device_move, progress: Callable[[], None] = lambda: None,
                 classes: Classes | None = None) -> MoveReport:
    """`deal` the states over the `new` instances (keeping `classes`) and `attach` each share; the summed report."""
    rep = MoveReport()
    for inst, sts in zip(new, deal(states, len(new), classes)):
        if sts:
            r = attach(sts, inst, sources, kv, mover=mover)
            for f in ("migrated", "recomputed", "pages_moved", "kv_bytes", "kv_bytes_predicted", "seconds"):
                setattr(rep, f, getattr(rep, f) + getattr(r, f))
            progress()
    return rep


def buffers(tree) -> set[int]:
    """Device buffer addresses of every shard of every live leaf (to tell aliased arrays apart)."""
    return {s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(tree) if not x.is_deleted()
            for s in x.addressable_shards}


def _delete(tree, keep: set[int]):
    """Free every leaf none of whose buffers is in `keep` (aliases of arrays someone else still holds)."""
    for x in jax.tree.leaves(tree):
        if not x.is_deleted() and not buffers(x) & keep:
            x.delete()


def _reusable(svc, old, meshes) -> bool:
    """Whether the old copies can serve the new instances by slices (same padded vocabulary everywhere)."""
    rows = {padded_vocab_for(svc.cfg, Layout(tp=i.tp)) for i in old}
    rows |= {padded_vocab_for(svc.cfg, Layout(tp=m.shape["tp"])) for m in meshes}
    return len(rows) == 1


def _contiguous_bytes(svc, abstract, old_meshes, new_meshes) -> int:
    """What the reusing reshard would move if every group kept its devices in pool order (no nested order)."""
    def plain(mesh):
        devs = sorted(mesh.devices.flat, key=svc.devices.index)
        return svc.weight_shardings(Layout(tp=len(devs)).make_mesh(devs))

    sources = [plain(m) for m in old_meshes]
    return sum(tree_reuse_bytes(abstract, sources, plain(m)) for m in new_meshes)


def _reshard_from_one(svc, old, meshes, weights, max_batch, num_pages, probe):
    """Steps 3-5 from one source copy: free the redundant old copies, reshard the remaining one layer by layer (or
    the caller's `weights`, a weight sync: as `update_weights` moves them, small leaves whole) into each new
    instance, the last copy consuming the source."""
    if weights is None:
        src_w, external, stale = old[0].weights, old[0].external, old[1:]
    else:
        src_w, external, stale = weights, buffers(weights), old
    src_buf = buffers(src_w)
    for inst in stale:
        _delete(inst.weights, src_buf | inst.external | external)
    probe()
    new, weight_bytes, held, weight_s = [], 0, set(), 0.0
    whole = 0 if weights is None else svc.SYNC_WHOLE_LEAF_BYTES
    for j, mesh in enumerate(meshes):                           # 4. weights, 5. instances
        keep = external | held                                   # buffers someone else still needs
        last = j == len(meshes) - 1
        t_w = time.perf_counter()
        w, r = svc.place(src_w, mesh, progress=probe, donate=(lambda x: not buffers(x) & keep) if last else False,
                         whole_leaf_bytes=whole)
        jax.block_until_ready(w)
        weight_s += time.perf_counter() - t_w
        mine = buffers(w)
        held |= mine
        weight_bytes += r.bytes_moved
        inst = svc.build_instance(j, mesh, w, max_batch=max_batch, num_pages=num_pages)
        inst.external = mine & external
        new.append(inst)
        probe()
    _delete(src_w, external | held)
    return new, weight_bytes, weight_s


def plan_layout(tp: int | Seq[int], instances: int | None, devices: list) -> list[list]:
    """Device groups of the instances: `tp` x `instances` (uniform) or one group per entry of a tp list,
    contiguous blocks from the start of `devices`, each in `sharding.nested_order` (so that a merge to a
    larger TP finds every device's new shard inside the one it holds: `sharding.reuse`)."""
    tps = [int(tp)] * (instances or 1) if isinstance(tp, int) else [int(t) for t in tp]
    if isinstance(tp, int) is False and instances not in (None, len(tps)):
        raise ValueError(f"tp={list(tps)} lists {len(tps)} instances but instances={instances}")
    if not tps or min(tps) < 1:
        raise ValueError(f"tp={tp!r}: need at least one instance of tp >= 1")
    if sum(tps) > len(devices):
        raise ValueError(f"instances of tp {tps} need {sum(tps)} devices, have {len(devices)}")
    return tp_groups(devices, tps)


def relayout(svc, groups: list[list], *, kv: str, max_batch: int, num_pages: int | None,
             probe: Callable[[], None] | None = None, weights=None, classes: Classes | None = None):
    """Rebuild `svc`'s instances on the device `groups` (see module docstring). Returns (instances, report).
    `weights` (this process's arrays, any layout): the new instances' weights come from them instead of the
    old rollout copy, which is then freed — a weight sync riding the relayout (one reshard, not two); the
    caller's arrays are never freed or donated. `classes` (`skew.Classes` on the new instances): StreamRL's
    long/regular classes, each dealt over its own new instances."""
    probe = probe or (lambda: None)
    old = svc.instances
    compiles0 = old[0].executor.cache.compiles
    states = [inst.detach(inst.live_rids(), keep_kv=kv == "migrate") for inst in old]
    sources: dict[int, PoolSource] = {}
    if kv == "migrate":                                         # 2. stage the live KV
        for inst, sts in zip(old, states):
            pages = list(dict.fromkeys(p for st in sts for p in st.pages))
            if pages:
                sources[inst.index] = PoolSource(inst.kv.take(pages), lambda _: None,
                                                 {p: r for r, p in enumerate(pages)})
                probe()
    for inst in old:                                            # 3. free old pools
        inst.kv.delete()
    probe()
    meshes = [Layout(tp=len(devs)).make_mesh(devs) for devs in groups]
    t_w = time.perf_counter()
    contiguous = None
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), old[0].weights)
    if weights is None and _reusable(svc, old, meshes):
        # 4. every new copy from local slices of the old copies (sharding.reuse), each old leaf freed once
        # every new instance has it
        external = set().union(*(inst.external for inst in old))
        ws, r = reshard_reusing([inst.weights for inst in old], [svc.weight_shardings(m) for m in meshes],
                                consumed=lambda x: not buffers(x) & external, progress=probe)
        weight_bytes, weight_s = r.bytes_moved, time.perf_counter() - t_w
        contiguous = _contiguous_bytes(svc, abstract, [inst.mesh for inst in old], meshes)
        new = []
        for j, (mesh, w) in enumerate(zip(meshes, ws)):          # 5. instances
            new.append(svc.build_instance(j, mesh, w, max_batch=max_batch, num_pages=num_pages))
            new[-1].external = buffers(w) & external
            probe()
        for inst in old:
            _delete(inst.weights, external | set().union(*(buffers(w) for w in ws)))
    else:
        new, weight_bytes, weight_s = _reshard_from_one(svc, old, meshes, weights, max_batch, num_pages, probe)
    probe()
    everything = sorted((st for sts in states for st in sts), key=lambda st: st.rid)
    rep = attach_dealt(everything, new, sources, kv, progress=probe, classes=classes)
    for src in sources.values():
        for x in src.kv:
            x.delete()
    probe()
    report = RelayoutReport([i.tp for i in old], [i.tp for i in new], len(everything), rep, weight_bytes,
                            weight_bytes if contiguous is None else contiguous,
                            compiles=new[0].executor.cache.compiles - compiles0, weight_seconds=weight_s)
    return new, report
