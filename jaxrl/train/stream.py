"""RollPacker's stream trainer (arXiv 2509.21009 §4.4, Algorithm 1): gradients of completed groups on
rollout devices freed mid-rollout, one update at the end that equals the synchronous one.

    st = StreamTrainer(cfg, cfg.trainer.stream, model_cfg, spec, updater, train_mesh, pack_len=.., mb_rows=..)
    st.warm(params, opt_state, ref_params, svc=svc)  # once: the freed devices' executables, nothing runs after
    st.begin(params, ref_params)                     # each step, before its rollout
    ...  after every svc.step():        st.on_progress(svc, finished, total)    # may shrink the pool
    ...  each completed, scored group:  st.add_group(samples)                   # rl.Sample with advantages
    params, opt_state, metrics = st.finish(params, opt_state)                   # after the rollout

**The decision** (when, which devices, whether, how: Algorithm 1, lines 14-20) is `jaxrl.train.shrink`.

**Gradients (line 23) and the update.** `rl.batch_weights(fold=False)` semantics: each sample carries its
unnormalised 1/q_i; the denominator D (tokens or sequences of the whole batch) is known only at the end.
Completed groups wait until devices are freed; then they are packed into fixed (mb_rows x pack_len)
micro-batches, one whenever the waiting samples fill one, and `grad_step` (plus the reference log-probs
when algo.kl_coef > 0) runs on a sub-mesh of the freed devices (train rules, fsdp x the train tp) with
copies of the weights placed there — no update. `finish` computes every remaining sample on the whole
train mesh, sums both accumulators onto it (`sum_onto`), divides by D once and applies one update
(`apply_update`): the synchronous update up to float32 summation order.

Simplified versus the paper (and why):
* The freed instances keep their KV pool and rollout weights allocated while their devices train (the
  service has no call to release and re-allocate a pool); on a GPU the weight copies and gradient sums
  must fit beside them. The paper's engine releases that memory.
* The reference log-probs use a second weight copy on the freed devices, not the paper's swap of actor
  and reference weights; gradient sums stay on the devices (the paper offloads them to the host).
* A micro-batch starts only when waiting samples fill it; the last partial one runs on the full mesh at
  the end. The paper's producer-consumer rate matching is not modelled, nor is the decode slow-down
  after the shrink (the paper omits it too).
* The service's router does not know about the shrink: a loop that adds requests mid-step must route
  them to `rollout_instances(svc)`.

**On StreamRL's disaggregated pools** (one process): the stream trainer adds its freed devices to the train
pool's gradient stream (`gs=`, fed from the rollout's start on the train worker's thread) as a second target;
`finish` runs on that thread. With `stage_balance.scale_up` a shrink frees half of the pool the rollout runs
on, and `warm_grown` compiles the freed devices' executables for each pool size.

**Several processes (DistFlow's multi-controller).** Each process's pool is its own instances: it checks
its own milestones on its own requests and frees the trailing half of its own instances, at its own time;
its streamed micro-batches hold its own samples, on its own freed devices, so nothing crosses processes
until `finish`, which every process reaches at the same point of the step: the remaining samples run as
global micro-batches on the train mesh (each process's rows; their count agreed), each process's early
sums go through its host (the paper offloads them there) into one sum over processes
(`GradientStream._process_sum`), D is counted over all processes, and one update follows. The copy a shrink
needs is process-local: the weights come from a freed instance's rollout copy (already the step's weights,
on those devices: what the paper's freed GPUs hold) and, with algo.kl_coef > 0, the reference from a copy
placed on the freed devices at `begin` (a collective every process makes, once per reference). The update
equals the 1-process one up to float32 summation order; `stream/` counts are summed over processes
(`stream/shrunk`: how many pools shrank), `stream/shrunk_at` and `stream/move_s` are the process's own.
"""

from __future__ import annotations

import collections
import dataclasses
import time
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl.config.base import ConfigError
from jaxrl.config.stream import StreamSection, check_stream
from jaxrl.rollout.executor import abstract
from models import fit_vocab, logical_axes, lora, vocab_rows
from sharding import Layout, ShardingRules, reshard, shardings_for

from .batch import FIELDS, Sample
from .distributed import global_sum
from .grad_stream import ROWS, GradientStream, warm_sum
from .rollout_kv import export_pages
from .shrink import ShrinkPlan, freed_instances, milestone_due, shrink_plan, take_shrink
from .update import Updater, needs_policy_logprobs


# ----------------------------------------------------------------------------- the component
@dataclasses.dataclass
class _SubMesh:
    devices: tuple
    mesh: object
    params: object          # train-rule shardings of the weights on `mesh`
    rows: NamedSharding     # micro-batch rows over the sub-mesh's data axes


class StreamTrainer:
    """Per RL step: `begin`, `on_progress` after each rollout step, `add_group` per scored group, `finish`.
    See the module docstring; `metrics` keys are under `stream/`."""

    def __init__(self, cfg, stream: StreamSection, model_cfg, spec, updater: Updater, mesh, *, pack_len: int,
                 mb_rows: int, stager=None, gs: GradientStream | None = None):
        """`gs`: the gradient stream to add the freed devices to as a target (StreamRL's disaggregated pools:
        the train pool's, which streams from the rollout's start); default one of its own."""
        check_stream(stream, cfg)
        if cfg.algo.mini_batches != 1:      # also when disabled: `finish` is one update per rollout batch
            raise ConfigError("algo.mini_batches", f"{cfg.algo.mini_batches}: the stream trainer applies one "
                              "update per rollout batch; set 1")
        self.cfg, self.stream, self.model_cfg, self.spec, self.updater = cfg, stream, model_cfg, spec, updater
        self.mesh, self.pack_len, self.mb_rows = mesh, pack_len, mb_rows
        self.gs = gs or GradientStream(cfg, spec, updater, mesh, pack_len=pack_len, mb_rows=mb_rows, stager=stager)
        self.train_rows = self.gs.train_rows
        self.history: collections.deque = collections.deque(maxlen=stream.history)
        self._subs: dict[tuple, _SubMesh] = {}
        self._ref_copy = None        # (key, the reference on the freed devices), several processes only
        self._reset(None, None)

    # ------------------------------------------------------------------ step lifecycle
    def begin(self, params, ref_params=None, svc=None):
        """Start a step whose gradients are taken at `params` (the train mesh's; the early gradients use a
        copy made at the shrink, so `finish` must get the same values). `ref_params`: needed when
        algo.kl_coef > 0. `svc`: the rollout service; with several processes and a reference, its freed
        devices get their copy of the reference now, where every process calls this (once per reference)."""
        if self.spec.kl_coef and ref_params is None:
            raise ValueError("algo.kl_coef > 0: begin() needs the reference weights")
        self._reset(params, ref_params)
        self.gs.begin(ref_params)
        if jax.process_count() > 1 and self.spec.kl_coef and not lora.has_adapters(params) and svc is not None:
            self._place_ref(svc)

    def _place_ref(self, svc):
        """Several processes: each process's freed devices hold a copy of the reference, made at `begin`
        (a collective), since a shrink is each process's own decision, at its own time, where no copy from
        the train mesh's global arrays can be made. Made once per reference and kept (the reference does not
        change between steps); without any shrink possible (`freed_instances`), none."""
        freed = freed_instances(svc.layout)
        if freed is None:
            return
        devices = [d for k in freed for d in svc.instances[k].mesh.devices.flat]
        key = (id(jax.tree.leaves(self._ref)[0]), tuple(d.id for d in devices))
        if self._ref_copy is None or self._ref_copy[0] != key:
            if self._ref_copy is not None:
                _delete(self._ref_copy[1])
            self._ref_copy = (key, local_copy(self._ref, self._sub_for(devices).params))

    def _reset(self, params, ref_params):
        self._params, self._ref = params, ref_params
        self._sub = self._sub_params = self._sub_ref = None
        self._own: list = []
        self._freed: tuple[int, ...] = ()
        self._last = self.checks = self.moved = 0
        self.shrunk_at = self.move_s = 0.0
        self.plan: ShrinkPlan | None = None

    def rollout_instances(self, svc) -> list[int]:
        """Indices of the instances still generating (all of them before a shrink)."""
        return [k for k in range(len(svc.instances)) if k not in self._freed]

    def on_progress(self, svc, finished: int, total: int, classes: dict[int, str] | None = None
                    ) -> ShrinkPlan | None:
        """After each `svc.step()`: at a due milestone, plan and maybe take the shrink (moving requests within
        `classes`, StreamRL's long/regular instances, when given). Returns the milestone's plan (None when
        no check was due)."""
        self._check_begun()
        if self._freed:
            busy = [k for k in self._freed if svc.instances[k].live_rids()]
            if busy:
                raise RuntimeError(f"instances {busy} were freed for training but got requests: route new ones "
                                   f"to StreamTrainer.rollout_instances(svc) = {self.rollout_instances(svc)}")
            return None
        s = self.stream
        if not s.enabled or not milestone_due(finished, total, self._last, start=s.start, stop=s.stop, step=s.step):
            return None
        self._last, self.checks = finished, self.checks + 1
        plan = shrink_plan(svc, s, self.history, classes)
        self.plan = plan
        if not plan.ok:
            return plan
        devices = [d for k in plan.freed for d in svc.instances[k].mesh.devices.flat]
        try:
            self._sub_for(devices)
        except ValueError as e:            # the freed devices cannot hold the train layout / micro-batch
            plan.ok, plan.reason = False, str(e)
            return plan
        t0 = time.perf_counter()
        self.moved += take_shrink(svc, plan)
        self.move_s = time.perf_counter() - t0
        self._freed, self.shrunk_at = plan.freed, finished / total
        self.repurpose(devices, source=svc.instances[plan.freed[0]].weights)
        return plan

    def repurpose(self, devices, source=None):
        """Compute gradients on `devices` from now on (also what `on_progress` calls after moving the
        requests): the weights are copied there and the groups held so far start. `source`: the weights to
        copy, the step's own (`on_progress` passes a freed instance's rollout copy, already on those devices,
        as in the paper, and process-local); default the train mesh's, one process only."""
        self._check_begun()
        if source is None and jax.process_count() > 1:
            raise ValueError("several processes: repurpose() needs the step's weights on this process's devices "
                             "(`source`, e.g. a freed rollout instance's copy)")
        self._sub = self._sub_for(devices)
        src = self._params if source is None else fit_vocab(source, vocab_rows(self._params))
        self._sub_params, _ = reshard(src, self._sub.params)
        self._own = [x for x in jax.tree.leaves(self._sub_params) if not any(x is y for y in jax.tree.leaves(src))]
        if self.spec.kl_coef:       # LoRA: the reference is the base, already there inside the copied params
            if lora.has_adapters(self._sub_params):
                self._sub_ref = lora.base(self._sub_params)
            elif self._ref_copy is not None:
                self._sub_ref = self._ref_copy[1]
            else:
                self._sub_ref = reshard(self._ref, self._sub.params)[0]
                self._own += jax.tree.leaves(self._sub_ref)
        self.gs.target(self._sub_params, self._sub_ref, self._sub.rows)

    def add_group(self, samples: list[Sample]):
        """A completed, scored group (its samples with their advantages): its gradient starts on the freed
        devices as soon as waiting samples fill a micro-batch; before a shrink it is held."""
        self._check_begun()
        samples = list(samples)
        self.history.extend(len(s.response) for s in samples)
        self.gs.add(samples)

    def combine(self, params):
        """Gradient and stats sums of every sample (the remaining ones computed now on the train mesh at
        `params`), summed onto the train mesh, and the denominator D: (grad_sums, stats_sums, D). Computed
        once per step (`finish` reuses it)."""
        self._check_begun()
        return self.gs.combine(params)

    def finish(self, params, opt_state):
        """After the rollout: the remaining gradients on the whole train mesh, every sum combined, divided by
        D once, one update. params / opt_state are donated. Returns (params, opt_state, metrics)."""
        self._check_begun()
        params, opt_state, m = self.gs.apply(params, opt_state)
        m = jax.device_get(m)
        gs = self.gs
        groups, samples, _ = gs.counts(self._sub.rows) if self._sub else (0, 0, 0)     # on the freed devices
        counts = {"stream/shrunk": int(bool(self._freed)), "stream/freed_devices": len(self._sub.devices) if self._sub else 0,
                  "stream/groups_early": groups, "stream/groups_late": gs.groups - gs.groups_early,
                  "stream/samples_early": samples, "stream/checks": self.checks, "stream/moved": self.moved,
                  "stream/peak_pages": self.plan.peak_pages if self.plan else 0,
                  "stream/budget_pages": self.plan.budget_pages if self.plan else 0}
        summed = global_sum(list(counts.values()))          # every process's pool (one process: its own)
        m.update({k: int(v) for k, v in zip(counts, summed)})
        m.update({"stream/shrunk_at": self.shrunk_at, "stream/move_s": self.move_s})
        _delete(self._own)              # the copies made for this step (not a rollout instance's own weights)
        self._reset(None, None)         # (the gradient stream's counts stay until the next begin: metrics read them)
        return params, opt_state, m

    # ------------------------------------------------------------------ warm-up
    def warm(self, params, opt_state, ref_params=None, *, svc=None, devices=None) -> int:
        """Compile what a streamed step runs: the update's executables on the train mesh (`Updater.warm`),
        and on the sub-mesh of the devices a shrink frees (`devices`, else `svc`'s trailing half) the
        zero sums, the gradient step and the reference log-probs; the weight copy onto
        it and the final sum run once on zeros/copies (plain jitted programs). Returns new compilations
        in the updater's cache (the others are counted by `runtime.CompileCounter`)."""
        before = self.updater.cache.compiles
        mb = self.gs.abstract_mb(self.train_rows)
        self.updater.warm(params, opt_state, mb, logp_params=[ref_params] if self.spec.kl_coef else [],
                          own_logp=needs_policy_logprobs(self.cfg))
        source = params
        if devices is None and svc is not None:
            devices, source = self._freed_by(svc, len(svc.instances), params)
        if devices is not None:
            self._warm_freed(params, devices, source)
        warm_sum(self.gs, params)                 # the final sum's add program
        return self.updater.cache.compiles - before

    def warm_grown(self, params, svc, counts) -> int:
        """StreamRL's scale-up: what a shrink of each grown pool of `counts` instances runs (`svc` laid out on
        at least the largest; instances keep their devices as the pool grows). A pool with no half to free,
        or whose freed devices cannot hold the micro-batch, is skipped: it never shrinks (`on_progress`).
        Returns new compilations in the updater's cache."""
        before = self.updater.cache.compiles
        for k in counts:
            devices, source = self._freed_by(svc, k, params)
            if devices is None:
                continue
            try:
                self._sub_for(devices, vocab_rows(params))
            except ValueError:
                continue
            self._warm_freed(params, devices, source)
        return self.updater.cache.compiles - before

    def _freed_by(self, svc, instances: int, params):
        """(devices, weights to copy) a shrink of `svc`'s first `instances` instances frees and copies from (a
        freed instance's rollout weights), or (None, None) when no half can be freed."""
        freed = freed_instances([i.tp for i in svc.instances[:instances]])
        if freed is None:
            return None, None
        devices = [d for k in freed for d in svc.instances[k].mesh.devices.flat]
        return devices, fit_vocab(svc.instances[freed[0]].weights, vocab_rows(params))

    def _warm_freed(self, params, devices, source):
        """The freed `devices`' executables: the weight copy from `source` (run once), the reference log-probs,
        the K/V staging (kv_source=rollout), the zero sums and the gradient step."""
        sub = self._sub_for(devices, vocab_rows(params))
        placed = reshard(source, sub.params)[0]            # the weight copy's programs, run once
        p = abstract(placed)
        _delete([x for x in jax.tree.leaves(placed) if not any(x is y for y in jax.tree.leaves(source))])
        smb = self.gs.abstract_mb(sub.rows)
        if self.spec.kl_coef:
            self.updater.cache.compile("logp", self.updater.logp, lora.base(p),    # (LoRA: the base)
                                       {k: smb[k] for k in FIELDS})
        stager = self.gs.stager_for(sub.rows)      # kv_source=rollout: the staging writes and gather there
        if stager is not None:
            stager.warm(*export_pages(self.cfg), self.gs.local_rows, self.gs.row_len)
        self.updater.warm_accumulate(p, smb, **self.gs.abstract_kv(sub.rows))

    # ------------------------------------------------------------------ internals
    def _check_begun(self):
        if self._params is None:
            raise RuntimeError("StreamTrainer: call begin(params, ref_params) before the step")

    def _sub_for(self, devices, vocab: int | None = None) -> _SubMesh:
        """The sub-mesh over `devices` (train rules: fsdp = len / train tp, the train tp), cached."""
        key = tuple(d.id for d in devices)
        if key not in self._subs:
            n, tp = len(devices), self.mesh.shape["tp"]
            if n % tp:
                raise ValueError(f"{n} freed devices do not hold whole groups of the train tp={tp}")
            if self.gs.local_rows % (n // tp):
                raise ValueError(f"{self.gs.local_rows}-row micro-batches do not divide over the freed devices' "
                                 f"fsdp={n // tp}")
            layout = Layout(fsdp=n // tp, tp=tp)
            mesh = layout.make_mesh(list(devices))
            vocab = vocab or vocab_rows(self._params)
            params = shardings_for(logical_axes(self.model_cfg, vocab_size=vocab), mesh,
                                   ShardingRules.train(self.model_cfg, layout))
            self._subs[key] = _SubMesh(tuple(devices), mesh, params, NamedSharding(mesh, ROWS))
        return self._subs[key]


def local_copy(tree, shardings):
    """A process-local copy of the global `tree` as `shardings` (on this process's devices): each leaf is
    replicated over its own devices (a collective: every process calls this at the same point), and this
    process's first copy moves to its target on the process's devices. One leaf at a time, so the transient
    is one leaf replicated."""
    out = []
    for x, target in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
        devices = np.empty(len(x.sharding.device_set), dtype=object)
        devices[:] = sorted(x.sharding.device_set, key=lambda d: d.id)     # (the same order on every process)
        whole = jax.device_put(x, NamedSharding(Mesh(devices, ("all",)), P()))
        out.append(jax.device_put(whole.addressable_shards[0].data, target))
    return jax.tree.unflatten(jax.tree.structure(tree), out)


def _delete(tree):
    for x in {id(x): x for x in jax.tree.leaves(tree)}.values():
        if not x.is_deleted():
            x.delete()

