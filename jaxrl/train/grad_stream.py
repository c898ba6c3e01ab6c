"""Gradients of completed, scored groups as they arrive, and one update at the end that equals the
synchronous one: the accumulation shared by RollPacker's stream trainer (gradients on rollout devices
freed mid-rollout, `stream.py`) and StreamRL's disaggregated pipeline (gradients on the train pool while
the generation pool still rolls out, `pipeline.py`).

    gs = GradientStream(cfg, spec, updater, train_mesh, pack_len=.., mb_rows=..)
    gs.begin(ref_params)                       # each step
    gs.target(params, ref, rows_sharding)      # from now on, streamed gradients run there (held groups start)
    gs.add(samples)                            # each completed, scored group (samples with advantages)
    params, opt_state, m = gs.apply(params, opt_state)   # the rest on the train mesh, sums combined, one update

**Exactness.** Each sample carries its unnormalised weight 1/q_i (`rl.batch_weights(fold=False)`): the
denominator D (tokens or sequences of the whole batch) is known only at the end, when `combine` sums every
accumulator onto the train mesh (`step.sum_onto`) and `apply` divides by D once. The result is the
synchronous update up to float32 summation order.

**Several targets** (RollPacker's stream trainer on StreamRL's disaggregated pools): the train pool is the
first target, from the rollout's start; a shrink adds the freed rollout devices as a second. Each
micro-batch goes to the target that would finish it first, counted in micro-batches per device
((dispatched + 1) / devices; ties to the earlier target) — simplified: device counts stand for throughput,
nothing is measured. Each target has its own accumulator; `combine` adds them in target order.

**Dynamic batches over fixed shapes.** Waiting groups are packed into fixed (mb_rows x pack_len)
micro-batches, whole groups in arrival order: the longest run of them that packs into one micro-batch goes
as soon as the next group would not fit (or it fills the micro-batch exactly); a group that alone needs
more rows goes by itself over several. How many micro-batches run, and when, is set by arrival; their
shape never changes, so nothing compiles after the warm-up. The rest waits for more groups or `combine`.

**Several processes** (the stream trainer: each process streams onto its own freed devices): a streamed
micro-batch holds this process's samples only, mb_rows / process_count rows (its share of a global one), on
a mesh of its own devices, so no streamed gradient waits for another process. `combine` is where they meet:
the rest as global micro-batches (each process's rows, their count agreed) and each process's early sums
summed over processes through the hosts (`_process_sum`).

`behaviour=True` (one-step-async): samples carry the rollout's own log-probs, packed as `old_logp`, the
behaviour policy of the importance ratio. `executor` (`pipeline.TrainWorker`): `add` and `target` run on
the train pool's thread (packing and dispatch off the caller's loop); `combine` waits for them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from . import rl
from .batch import FIELDS, INT_FIELDS, Sample, pack, pack_rows
from .distributed import global_max
from .step import sum_onto

ROWS = P(("dp", "fsdp"), None)


@dataclasses.dataclass
class Target:
    """Where streamed gradients run: weights (and the reference) over `rows`, with its own accumulator and
    counts of the work it took."""
    params: object
    ref: object
    rows: NamedSharding
    acc: object = None
    micro_batches: int = 0
    groups: int = 0
    samples: int = 0

    @property
    def devices(self) -> int:
        return self.rows.mesh.devices.size


def _rows(samples: list[Sample], pack_len: int) -> list[list[int]]:
    return pack_rows([len(s.prompt) + len(s.response) for s in samples], pack_len)


class GradientStream:
    def __init__(self, cfg, spec, updater, mesh, *, pack_len: int, mb_rows: int, behaviour: bool = False,
                 executor=None, stager=None):
        self.cfg, self.spec, self.updater, self.mesh = cfg, spec, updater, mesh
        self.pack_len, self.mb_rows, self.behaviour, self.executor = pack_len, mb_rows, behaviour, executor
        self.local_rows = mb_rows // jax.process_count()     # a streamed micro-batch: this process's share
        self.stager = stager              # MetroRLHF kv_source=rollout: the train mesh's `KVStager`
        self._stagers = {}                # ... and one per mesh the streamed gradients run on
        self.row_len = updater.padded_len(pack_len) if stager is not None else None
        self.max_new_tokens = cfg.rollout.max_new_tokens
        self.train_rows = NamedSharding(mesh, ROWS)
        self.begin(None)

    def keys(self) -> list[str]:
        """The fields of one micro-batch's gradient step."""
        return list(FIELDS) + ["ref_logp"] * bool(self.spec.kl_coef) + ["old_logp"] * self.behaviour

    # ------------------------------------------------------------------ step lifecycle
    def begin(self, ref_params):
        """A new step (the reference weights on the train mesh when algo.kl_coef > 0)."""
        self._ref = ref_params
        self.updater.reset_counts()
        self.targets: list[Target] = []        # where streamed gradients run, in the order they were set
        self._combined = None
        self._held, self._pending = [], []     # groups (lists of samples), oldest first
        self.samples: list[Sample] = []        # every sample of the step
        self.groups = 0                        # groups added this step (early ones: `groups_early`)

    def target(self, params, ref, rows: NamedSharding):
        """Run streamed gradients at `params` (and `ref`) over `rows` from now on, beside the targets set
        before this step (see "Several targets"); held groups start."""
        if self.executor is not None:
            self.executor.submit("grad", self._target, params, ref, rows)
        else:
            self._target(params, ref, rows)

    def _target(self, params, ref, rows):
        if not rows.is_fully_addressable:
            raise ValueError("several processes: streamed gradients run on this process's own devices")
        self.targets.append(Target(params, ref, rows))
        self._pending += self._held
        self._held = []
        self._drain()
        return self._busy()

    def _busy(self):
        """What a train-worker task waits for (its span is the train pool's busy time): the accumulators on
        the train mesh; another target's work runs on while the task returns."""
        return [t.acc for t in self.targets if t.rows.mesh is self.mesh]

    @property
    def groups_early(self) -> int:
        """Groups whose gradients ran as they arrived (every target's)."""
        return sum(t.groups for t in self.targets)

    @property
    def samples_early(self) -> int:
        return sum(t.samples for t in self.targets)

    @property
    def micro_batches_early(self) -> int:
        return sum(t.micro_batches for t in self.targets)

    def counts(self, rows: NamedSharding) -> tuple[int, int, int]:
        """(groups, samples, micro-batches) the target over `rows` took this step ((0, 0, 0): none)."""
        t = next((t for t in self.targets if t.rows is rows), None)
        return (t.groups, t.samples, t.micro_batches) if t else (0, 0, 0)

    def add(self, samples: list[Sample]):
        """A completed, scored group: its gradient starts as soon as waiting samples fill a micro-batch (held
        until `target` is set)."""
        if self.executor is not None:
            self.executor.submit("grad", self._add, list(samples))
        else:
            self._add(list(samples))

    def _add(self, samples):
        self.groups += 1
        self.samples += samples
        if not self.targets:
            self._held.append(samples)
        else:
            self._pending.append(samples)
            self._drain()
        return self._busy()

    def combine(self, params):
        """(grad_sums, stats_sums, D): every sample's gradient (the remaining ones computed now on the train
        mesh at `params`), summed onto the train mesh. Computed once per step."""
        if self._combined is not None:
            return self._combined
        if self.executor is not None:
            self.executor.barrier()
        if not self.samples:
            raise ValueError("no groups were added this step")
        late = [s for g in self._held + self._pending for s in g]
        acc = None
        for part, kv in self._late_micro_batches(late):
            acc = self._grad(params, self._ref, part, self.train_rows, acc, kv)
        shardings = self.grad_shardings(params)
        early = [t.acc for t in self.targets if t.acc is not None]
        if jax.process_count() > 1:         # each process's own early sums (maybe none), summed over processes
            early = [self._process_sum(early, params, shardings)]
        parts = [a for a in [acc, *early] if a is not None]
        total = sum_onto(parts[:1], shardings)
        for part in parts[1:]:              # ((late + first) + second) ...: one two-tree add program
            total = sum_onto([total, part], shardings)
        grads, stats = total
        _, denominator = rl.batch_weights(self.samples, self.cfg, self.max_new_tokens, fold=False)
        self._held, self._pending = [], []
        for t in self.targets:
            t.acc = None
        self._combined = (grads, stats, denominator)
        return self._combined

    def apply(self, params, opt_state):
        """`combine`, divide by D once, one optimizer update (params and opt_state donated). Returns
        (params, opt_state, metrics) with the metrics still on the devices."""
        grads, stats, denominator = self.combine(params)
        params, opt_state, m = self.updater.cache("apply", self.updater.apply, params, opt_state, grads,
                                                  float(denominator), stats)
        return params, opt_state, {**m, **self.updater.counts()}

    # ------------------------------------------------------------------ internals
    def abstract_mb(self, rows: NamedSharding) -> dict:
        """One micro-batch on `rows`: mb_rows rows on the train mesh, local_rows on a process's own devices."""
        n = self.local_rows if rows.is_fully_addressable else self.mb_rows
        return {k: jax.ShapeDtypeStruct((n, self.pack_len), jnp.int32 if k in INT_FIELDS else jnp.float32,
                                        sharding=rows) for k in self.keys()}

    def abstract_kv(self, rows: NamedSharding) -> dict:
        """`accumulate`'s rollout K/V argument on `rows` (abstract), as keywords: {} without kv_source=rollout."""
        stager = self.stager_for(rows)
        if stager is None:
            return {}
        return {"kv": stager.abstract(self.local_rows if rows.is_fully_addressable else self.mb_rows, self.row_len)}

    def abstract_sums(self, params):
        """The train mesh's gradient sums (abstract, with their shardings): where the combined sums go (the
        update's warmed input signature)."""
        return self.updater.warm_accumulate(params, self.abstract_mb(self.train_rows), **self.abstract_kv(self.train_rows))

    def stager_for(self, rows: NamedSharding):
        """The K/V stager of the mesh `rows` lives on (None without kv_source=rollout)."""
        if self.stager is None or rows.mesh is self.mesh:
            return self.stager
        key = tuple(d.id for d in rows.mesh.devices.flat)
        if key not in self._stagers:
            self._stagers[key] = self.stager.like(rows.mesh)
        return self._stagers[key]

    def grad_shardings(self, params):
        return jax.tree.map(lambda s: s.sharding, self.abstract_sums(params))

    def _grad(self, params, ref, part: dict, rows: NamedSharding, acc, kv=None):
        mb = {k: jax.device_put(v, rows) for k, v in part.items()}
        if self.spec.kl_coef:
            mb["ref_logp"] = self.updater.logprobs(ref, mb)
        return self.updater.accumulate(params, mb, acc) if kv is None else self.updater.accumulate(params, mb, acc, kv)

    def _caches(self, stager, samples: list[Sample], rows: list[list[int]], n: int, per: int) -> list:
        """The rollout K/V of `n` micro-batches of `per` rows (the samples packed as `rows`), staged anew on
        `stager`'s mesh; Nones without kv_source=rollout."""
        if stager is None:
            return [None] * n
        offsets = stager.stage([s.kv for s in samples])
        cached, lengths = [s.kv.length for s in samples], [len(s.prompt) + len(s.response) for s in samples]
        return [stager.packed(stager.index(rows, offsets, cached, lengths, j * per, per, self.row_len))
                for j in range(n)]

    def _micro_batches(self, samples: list[Sample], rows: list[list[int]], per: int | None = None, n: int | None = None):
        """Host micro-batches of `samples` packed as `rows`, `per` rows each (default local_rows; `n` of them,
        default as few as hold `rows`), the last padded with zero-weight rows; weights unnormalised (1/q_i:
        `rl.sample_weights`, local to this process)."""
        per = per or self.local_rows
        n = -(-len(rows) // per) if n is None else n
        if not n:
            return []
        weights = rl.sample_weights(samples, self.cfg, self.max_new_tokens)
        packed = pack(samples, weights, self.pack_len, n_rows=n * per, rows=rows, behaviour=self.behaviour)
        return [{k: v[j * per:(j + 1) * per] for k, v in packed.items()} for j in range(n)]

    def _late_micro_batches(self, samples: list[Sample]) -> list[tuple[dict, object]]:
        """The samples no streamed micro-batch took, as global micro-batches on the train mesh, each with its
        rollout K/V (or None): every process contributes mb_rows / process_count rows of its own to each, and
        the count is agreed (the largest; a process with fewer pads zero-weight rows), since each is one
        program over every process's devices."""
        procs = jax.process_count()
        local, rows = self.mb_rows // procs, _rows(samples, self.pack_len)
        n = global_max(-(-len(rows) // local))
        shape = (self.mb_rows, self.pack_len)
        parts = [{k: jax.make_array_from_process_local_data(self.train_rows, v, shape) for k, v in part.items()}
                 for part in self._micro_batches(samples, rows, local, n)]
        return list(zip(parts, self._caches(self.stager, samples, rows, n, local)))

    def _process_sum(self, sums: list, params, shardings):
        """Σ over processes of each process's own early sums (a list, one per target; empty: this process
        streamed nothing, zeros), onto the train mesh as `shardings`. Each process's sums go to its host (the
        paper offloads gradient sums to the host; several targets are added there, in order) and become its
        slice of a (processes, ...) array on the train mesh's devices, whole on each of the process's devices
        while they are summed."""
        abstract = self.abstract_sums(params)
        host = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract)
        if sums:
            host = functools.reduce(lambda x, y: jax.tree.map(np.add, x, y), jax.device_get(sums))
        sharding = NamedSharding(process_mesh(self.mesh), P("proc"))
        procs = jax.process_count()
        stacked = jax.tree.map(lambda x: jax.make_array_from_process_local_data(
            sharding, np.asarray(x)[None], (procs, *np.shape(x))), host)
        return _sum_first(stacked, shardings)

    def _drain(self):
        """Start micro-batches from the waiting groups, each on the target that would finish it first (see
        the module docstring)."""
        while self._pending:
            k, rows = 0, []
            while k < len(self._pending):
                r = _rows([s for g in self._pending[:k + 1] for s in g], self.pack_len)
                if len(r) > self.local_rows:
                    break
                k, rows = k + 1, r
            if k == len(self._pending) and len(rows) < self.local_rows:
                return
            if k == 0:
                k, rows = 1, _rows(self._pending[0], self.pack_len)
            samples = [s for g in self._pending[:k] for s in g]
            parts = self._micro_batches(samples, rows)
            t = min(self.targets, key=lambda t: (t.micro_batches + len(parts)) / t.devices)   # (first on ties)
            caches = self._caches(self.stager_for(t.rows), samples, rows, len(parts), self.local_rows)
            for part, kv in zip(parts, caches):
                t.acc = self._grad(t.params, t.ref, part, t.rows, t.acc, kv)
            t.micro_batches += len(parts)
            t.groups += k
            t.samples += len(samples)
            self._pending = self._pending[k:]


def process_mesh(mesh) -> Mesh:
    """`mesh`'s devices in their order as a ("proc", "local") mesh, one row per process. Raises when the
    order does not keep each process's devices together."""
    devices = np.asarray(mesh.devices).reshape(jax.process_count(), -1)
    if any(len({d.process_index for d in row}) != 1 for row in devices):
        raise ValueError(f"the train mesh's devices are not grouped by process: {mesh.devices.flat}")
    return Mesh(devices, ("proc", "local"))


def _sum_first(stacked, shardings):
    """Each leaf summed over its first axis (the processes, in order), placed as `shardings`."""
    key = (jax.tree.structure(stacked), jax.tree.structure(shardings))
    if key not in _SUM_FIRST:
        _SUM_FIRST[key] = jax.jit(lambda t: jax.tree.map(lambda x: functools.reduce(jnp.add, list(x)), t),
                                  out_shardings=shardings)
    return _SUM_FIRST[key](stacked)


_SUM_FIRST: dict = {}


def warm_sum(gs: GradientStream, params) -> None:
    """Run the combine's add programs once on zeros (what `combine` sums the accumulators with; with several
    processes, the sum over processes too)."""
    sums = gs.abstract_sums(params)
    shardings = jax.tree.map(lambda s: s.sharding, sums)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding), sums)
    jax.block_until_ready(sum_onto([zeros, zeros], shardings))
    if jax.process_count() > 1:
        jax.block_until_ready(gs._process_sum([], params, shardings))
