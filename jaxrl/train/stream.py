"""RollPacker's stream trainer (arXiv 2509.21009 §4.4, Algorithm 1): gradients of completed groups on
rollout devices freed mid-rollout, one update at the end that equals the synchronous one.

    st = StreamTrainer(cfg, cfg.trainer.stream, model_cfg, spec, updater, train_mesh, pack_len=.., mb_rows=..)
    st.warm(params, opt_state, ref_params, svc=svc)  # once: the freed devices' executables, nothing runs after
    st.begin(params, ref_params)                     # each step, before its rollout
    ...  after every svc.step():        st.on_progress(svc, finished, total)    # may shrink the pool
    ...  each completed, scored group:  st.add_group(samples)                   # rl.Sample with advantages
    params, opt_state, metrics = st.finish(params, opt_state)                   # after the rollout

**When (Algorithm 1, line 14).** `milestone_due`: once start <= finished/total <= stop (20%..50%) and
another `step` (5%) of the requests finished since the last check. At most one shrink per step.

**Which devices (the paper's "half of the rollout GPUs, TP groups intact").** `freed_instances`: the
trailing instances that hold exactly half the rollout devices (instance 0 always stays); none such ->
the attempt is aborted. The set is fixed by the layout, so `warm()` compiles one sub-mesh's executables
(the paper does not say which half; picking the least-loaded instances would need one compiled set per
choice).

**Whether (line 17: the projected peak KV).** `projected_lengths` gives each live request's final
length: "history" (the paper's "historical response length distributions"): a request that has
generated g tokens ends at the `quantile` of the recorded response lengths longer than g, capped at its
max_new_tokens (none longer -> the cap); "max": every request runs to its cap (a bound). `peak_pages`
turns final lengths into the peak of live pages over the remaining decode steps (usage grows by one
token per live request per step and drops when a request ends, so it peaks just before some request
ends). `plan_shrink` accepts when the peak of all live requests fits in `kv_fraction` of the whole pool's
pages and, after assigning the freed instances' requests to the remaining ones (largest first, to the
one least filled), each remaining instance's own peak fits its pages. Recomputed requests do not share
prompt pages, and none are counted as shared.

**How (line 20).** pause, detach the freed instances' live requests, attach them to their assigned
instances with kv="recompute" (tokens kept, KV re-prefilled; sampling continues on each request's own
RNG stream, so the tokens are those of a run without the shrink).

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
* One process only (`check_stream`). The service's router does not know about the shrink: a loop that
  adds requests mid-step must route them to `rollout_instances(svc)`.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxrl.config.base import ConfigError
from jaxrl.config.stream import StreamSection, check_stream
from models import logical_axes, lora, vocab_rows
from sharding import Layout, ShardingRules, reshard, shardings_for

from .batch import FIELDS, Sample
from .grad_stream import ROWS, GradientStream, warm_sum
from .update import Updater


# ----------------------------------------------------------------------------- the decision (pure)
def milestone_due(finished: int, total: int, last: int, *, start: float, stop: float, step: float) -> bool:
    """Algorithm 1, line 14: start <= |R_comp|/|R| <= stop and ΔR/|R| >= step, where ΔR counts the requests
    finished since the last check (`last` = finished then; 0 before the first)."""
    if total <= 0:
        return False
    eps = 1e-9 * total
    return start * total - eps <= finished <= stop * total + eps and finished - last >= step * total - eps


def freed_instances(tps: Sequence[int]) -> tuple[int, ...] | None:
    """The trailing instances holding exactly half of the rollout devices (each instance whole; instance 0
    always stays), or None when no such set exists."""
    half, acc = sum(tps) / 2, 0
    for k in range(len(tps) - 1, 0, -1):
        acc += tps[k]
        if acc == half:
            return tuple(range(k, len(tps)))
        if acc > half:
            break
    return None


def projected_lengths(rows: Sequence[dict], history: Sequence[int] = (), *, projection: str = "history",
                      quantile: float = 0.9) -> np.ndarray:
    """Final context length (prompt + response) of each live request, `svc.sequence_stats()` rows.

    "max": prompt + max_new_tokens. "history": prompt + the `quantile` of the recorded response lengths
    longer than the request's generated count (rounded up), at least one more token and at most
    max_new_tokens; with no longer recorded length, max_new_tokens."""
    prompt = np.asarray([r["prompt_len"] for r in rows], np.int64)
    gen = np.asarray([r["generated"] for r in rows], np.int64)
    cap = np.asarray([r["max_new_tokens"] for r in rows], np.int64)
    if projection == "max" or not len(history):
        return prompt + cap
    h = np.sort(np.asarray(history, np.int64))
    resp = cap.copy()
    for i, g in enumerate(gen):
        longer = h[np.searchsorted(h, g, side="right"):]
        if longer.size:
            resp[i] = int(np.ceil(np.quantile(longer, quantile)))
    return prompt + np.clip(resp, np.minimum(gen + 1, cap), cap)


def peak_pages(context, final, page_size: int) -> int:
    """Peak KV pages of requests now at `context` tokens that each grow by one token per decode step until
    `final`, freeing their pages then: max over steps t of Σ_{live at t} ceil((context + t) / page_size).
    Usage only grows between two ends, so the candidates are the steps at which some request ends."""
    c = np.asarray(context, np.int64)
    if c.size == 0:
        return 0
    left = np.maximum(np.asarray(final, np.int64), c) - c          # steps each request has left
    ends = np.unique(left)
    pages = -(-(c[:, None] + ends[None, :]) // page_size)
    return int(np.max(np.sum(pages * (ends[None, :] <= left[:, None]), axis=0)))


@dataclasses.dataclass
class ShrinkPlan:
    """One milestone's decision. `ok`: shrink now; else `reason` says why not."""

    ok: bool
    reason: str = ""
    freed: tuple[int, ...] = ()                          # instances that stop generating
    moves: dict[int, list[int]] = dataclasses.field(default_factory=dict)   # remaining instance -> request ids
    peak_pages: int = 0                                  # projected peak of every live request
    budget_pages: int = 0                                # kv_fraction x the whole pool's pages


def plan_shrink(rows: Sequence[dict], final: np.ndarray, instances: Sequence[tuple[int, int, int]], *,
                page_size: int, kv_fraction: float, classes: dict[int, str] | None = None) -> ShrinkPlan:
    """Algorithm 1, lines 16-17. `rows`: live requests (`svc.sequence_stats()`), `final` their projected
    final lengths, `instances`: (index, tp, pages) of every instance in order. `classes` (StreamRL's skew
    placement: instance -> "long" / "regular"): a moved request goes to a kept instance of its own
    instance's class when one is kept. See the module docstring."""
    tps = [tp for _, tp, _ in instances]
    freed = freed_instances(tps)
    if freed is None:
        return ShrinkPlan(False, f"no trailing instances hold half of the rollout devices (instance tp {tps})")
    idx = [i for i, _, _ in instances]
    freed = tuple(idx[k] for k in freed)
    ctx = np.asarray([r["context_len"] for r in rows], np.int64)
    final = np.asarray(final, np.int64)
    peak = peak_pages(ctx, final, page_size)
    budget = int(kv_fraction * sum(p for _, _, p in instances))
    plan = ShrinkPlan(False, freed=freed, peak_pages=peak, budget_pages=budget)
    if peak > budget:
        plan.reason = f"projected peak {peak} pages > {budget} (kv_fraction {kv_fraction} of the pool)"
        return plan
    cap = {i: p for i, _, p in instances if i not in freed}
    members = {i: [k for k, r in enumerate(rows) if r["instance"] == i] for i in cap}
    load = {i: sum(-(-final[k] // page_size) for k in members[i]) for i in cap}
    moved = sorted((k for k, r in enumerate(rows) if r["instance"] in freed), key=lambda k: -final[k])
    for k in moved:
        own = [i for i in cap if classes and classes.get(i) == classes.get(rows[k]["instance"])]
        target = min(own or cap, key=lambda i: (load[i] / cap[i], i))
        members[target].append(k)
        load[target] += -(-final[k] // page_size)
        plan.moves.setdefault(target, []).append(rows[k]["request_id"])
    for i in cap:
        own = peak_pages(ctx[members[i]], final[members[i]], page_size)
        if own > cap[i]:
            plan.moves, plan.reason = {}, f"instance {i}: projected peak {own} pages > its {cap[i]}"
            return plan
    plan.ok = True
    return plan


def shrink_plan(svc, s: StreamSection, history: Sequence[int], classes: dict[int, str] | None = None) -> ShrinkPlan:
    """Lines 16-17 on a rollout service: its live requests' projected final lengths (`s.projection`) and
    `plan_shrink` over its instances' pools (moves within `classes`, when given)."""
    rows = svc.sequence_stats()
    final = projected_lengths(rows, history, projection=s.projection, quantile=s.quantile)
    return plan_shrink(rows, final, [(i.index, i.tp, i.pool.capacity) for i in svc.instances],
                       page_size=svc.instances[0].pool.page_size, kv_fraction=s.kv_fraction, classes=classes)


def kept_instances(svc) -> int:
    """How many leading instances a shrink never frees (all of them when no half can be freed)."""
    freed = freed_instances(list(svc.layout))
    return len(svc.layout) if freed is None else min(freed)


def take_shrink(svc, plan: ShrinkPlan) -> int:
    """Line 20: pause (tokens in flight land; requests they finished come out of the next step), then move
    the freed instances' live requests to their assigned instances with kv="recompute". Returns how many
    moved."""
    svc.pause()
    live = {rid for k in plan.freed for rid in svc.instances[k].live_rids()}
    moved = 0
    for target, rids in plan.moves.items():
        rids = [r for r in rids if r in live]
        if rids:
            svc.attach(svc.detach(rids), instance=target, kv="recompute")
        moved += len(rids)
    return moved


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
                 mb_rows: int):
        check_stream(stream, cfg, processes=jax.process_count())
        if cfg.algo.mini_batches != 1:      # also when disabled: `finish` is one update per rollout batch
            raise ConfigError("algo.mini_batches", f"{cfg.algo.mini_batches}: the stream trainer applies one "
                              "update per rollout batch; set 1")
        self.cfg, self.stream, self.model_cfg, self.spec, self.updater = cfg, stream, model_cfg, spec, updater
        self.mesh, self.pack_len, self.mb_rows = mesh, pack_len, mb_rows
        self.gs = GradientStream(cfg, spec, updater, mesh, pack_len=pack_len, mb_rows=mb_rows)
        self.train_rows = self.gs.train_rows
        self.history: collections.deque = collections.deque(maxlen=stream.history)
        self._subs: dict[tuple, _SubMesh] = {}
        self._reset(None, None)

    # ------------------------------------------------------------------ step lifecycle
    def begin(self, params, ref_params=None):
        """Start a step whose gradients are taken at `params` (the train mesh's; the early gradients use a
        copy made at the shrink, so `finish` must get the same values). `ref_params`: needed when
        algo.kl_coef > 0."""
        if self.spec.kl_coef and ref_params is None:
            raise ValueError("algo.kl_coef > 0: begin() needs the reference weights")
        self._reset(params, ref_params)

    def _reset(self, params, ref_params):
        self._params, self._ref = params, ref_params
        self._sub = self._sub_params = self._sub_ref = None
        self._freed: tuple[int, ...] = ()
        self.gs.begin(ref_params)
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
        self.repurpose(devices)
        return plan

    def repurpose(self, devices):
        """Compute gradients on `devices` from now on (also what `on_progress` calls after moving the
        requests): the weights are copied there and the groups held so far start."""
        self._check_begun()
        self._sub = self._sub_for(devices)
        self._sub_params, _ = reshard(self._params, self._sub.params)
        if self.spec.kl_coef:       # LoRA: the reference is the base, already there inside the copied params
            self._sub_ref = lora.base(self._sub_params) if lora.has_adapters(self._sub_params) else \
                reshard(self._ref, self._sub.params)[0]
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
        m.update({"stream/shrunk": int(bool(self._freed)), "stream/shrunk_at": self.shrunk_at,
                  "stream/freed_devices": len(self._sub.devices) if self._sub else 0,
                  "stream/groups_early": gs.groups_early, "stream/groups_late": gs.groups - gs.groups_early,
                  "stream/samples_early": gs.samples_early, "stream/checks": self.checks,
                  "stream/moved": self.moved, "stream/move_s": self.move_s,
                  "stream/peak_pages": self.plan.peak_pages if self.plan else 0,
                  "stream/budget_pages": self.plan.budget_pages if self.plan else 0})
        for x in {id(x): x for x in jax.tree.leaves((self._sub_params, self._sub_ref))}.values():
            x.delete()
        self._reset(None, None)
        return params, opt_state, m

    # ------------------------------------------------------------------ warm-up
    def warm(self, params, opt_state, ref_params=None, *, svc=None, devices=None) -> int:
        """Compile what a streamed step runs: the update's executables on the train mesh (`Updater.warm`),
        and on the sub-mesh of the devices a shrink frees (`devices`, else `svc`'s trailing half) the
        gradient step with and without an accumulator and the reference log-probs; the weight copy onto
        it and the final sum run once on zeros/copies (plain jitted programs). Returns new compilations
        in the updater's cache (the others are counted by `runtime.CompileCounter`)."""
        before = self.updater.cache.compiles
        mb = self.gs.abstract_mb(self.train_rows)
        self.updater.warm(params, opt_state, mb, logp_params=[ref_params] if self.spec.kl_coef else [])
        if devices is None and svc is not None:
            freed = freed_instances(svc.layout)
            devices = None if freed is None else [d for k in freed for d in svc.instances[k].mesh.devices.flat]
        if devices is not None:
            sub = self._sub_for(devices, vocab_rows(params))
            placed = reshard(params, sub.params)[0]            # the weight copy's programs, run once
            p = _abstract(placed)
            for x in jax.tree.leaves(placed):
                x.delete()
            smb = self.gs.abstract_mb(sub.rows)
            if self.spec.kl_coef:
                self.updater.cache.compile("logp", self.updater.logp, lora.base(p),    # (LoRA: the base)
                                           {k: smb[k] for k in FIELDS})
            self.updater.warm_accumulate(p, smb)
        warm_sum(self.gs, params)                 # the final sum's add program
        return self.updater.cache.compiles - before

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
            if self.mb_rows % (n // tp):
                raise ValueError(f"{self.mb_rows}-row micro-batches do not divide over the freed devices' "
                                 f"fsdp={n // tp}")
            layout = Layout(fsdp=n // tp, tp=tp)
            mesh = layout.make_mesh(list(devices))
            vocab = vocab or vocab_rows(self._params)
            params = shardings_for(logical_axes(self.model_cfg, vocab_size=vocab), mesh,
                                   ShardingRules.train(self.model_cfg, layout))
            self._subs[key] = _SubMesh(tuple(devices), mesh, params, NamedSharding(mesh, ROWS))
        return self._subs[key]


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)

