"""The rollout engine on a virtual clock: the engine's own host code, a simulated executor.

    svc = SimService(model_cfg, cost, clock, devices=8, tp=2, instances=4, lengths=oracle.lengths, ...)
    rids = svc.add(prompt, params)        # RolloutService.add: routing, sequences, groups
    while svc.has_work():
        done = svc.step()                 # Instance.launch / collect on every instance; the clock advances

`SimService` is a `RolloutService` whose instances are `SimInstance`s: `Instance` subclasses whose KV store
and executor are stand-ins. Everything that decides runs unchanged: admission, pages, prefix sharing,
preemption and retirement (`Scheduler`), the launch/collect loop with step n+1 dispatched before step n is
read (`Instance`), routing, abort, pause, detach/attach (`RolloutService`), and a relayout's dealing and
page mapping (`migration.attach_dealt`). So PAT's controller (`tp_switch.AdaptiveTP`, which calls
`svc.relayout`), tail batching's race (`rl.rollout_and_score`, which calls `svc.abort`), the stream
trainer's shrink (detach/attach) and StreamRL's batch caps act on it as on the real service.

The executor does no arithmetic. A decode step returns, for each sequence, the token its response length
says (`TokenOracle`: the sample's filler token, then the stop token at the response's last position) and
adds the step's seconds from the cost model (`jaxrl.sim.cost`) to its instance; a prefill call adds its
seconds. `SimService` advances the clock once every instance has dispatched (`RolloutService._dispatched`)
by the slowest instance's step (instances run concurrently on disjoint devices; the host loop dispatches
them in lockstep) plus the host's per-step time, and records each instance's busy span on its devices.
Where instances share hardware (a profile measured on the CPU, whose fake devices share its cores) the
profiled contention κ adds the others' steps in part: longest + κ·(the rest).

A relayout (PAT's switch, the planner's layout change) costs, on the clock: the KV pages moved (Eq. 2:
the most bytes any target rank receives / the cost model's migration bandwidth), the weight reshard and the
control overhead from the cost model; `kv="recompute"` sequences pay their re-prefill in later launches,
as on the engine. Simplified (stated): page copies for prefix sharing cost nothing; a step's time is the
cost model's, whatever the host does meanwhile.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence as Seq

import numpy as np

from jaxrl.rollout import migration
from jaxrl.rollout.instance import Instance
from jaxrl.rollout.params import SamplingParams
from jaxrl.rollout.scheduler import DecodeBatch, PrefillBatch, Scheduler
from jaxrl.rollout.service import KV_MODES, ROUTERS, RolloutService, plan_layout
from jaxrl.rollout.shapes import ShapeBuckets
from jaxrl.train.pipeline import Timeline
from models import ModelConfig
from sharding import Layout

EOS = 1           # the stop token of simulated responses
FILLER = 2        # sample j of a request emits FILLER + j (mod the vocabulary) before its stop token


class Clock:
    """Virtual seconds; `clock()` reads it (a `RolloutService.clock`)."""

    def __init__(self, now: float = 0.0):
        self.now = float(now)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        if not seconds >= 0:
            raise ValueError(f"the clock cannot go back ({seconds} s)")
        self.now += float(seconds)
        return self.now


class TokenOracle:
    """Each request's response length (tokens, its stop token included) and filler token, by request id."""

    def __init__(self, vocab: int, eos: int = EOS):
        self.vocab, self.eos = int(vocab), int(eos)
        self._table: dict[int, tuple[int, int]] = {}

    def set(self, rid: int, length: int, sample: int) -> None:
        if length < 1:
            raise ValueError(f"request {rid}: response length {length} < 1")
        span = max(1, self.vocab - FILLER)
        self._table[rid] = (int(length), FILLER + sample % span)

    def token(self, rid: int, step: int) -> int:
        """The token of request `rid` at sampling step `step` (0-based)."""
        length, filler = self._table[rid]
        return self.eos if step + 1 >= length else filler

    def length(self, rid: int) -> int:
        return self._table[rid][0]


def sample_of(tokens: Seq[int]) -> int:
    """Which sample of its request a simulated response is (from its filler token)."""
    return int(tokens[0]) - FILLER if tokens and tokens[0] != EOS else 0


class SimKV:
    """Stands in for an instance's `KVStore`: holds nothing, counts the page copies asked of it."""

    def __init__(self, tp: int):
        self.tp, self.copies = tp, 0

    def copy_pages(self, pairs) -> "SimKV":
        self.copies += len(pairs)
        return self

    def delete(self) -> None:
        pass


class SimExecutor:
    """Stands in for `Executor`: returns the oracle's tokens and charges each call's seconds to `seconds`."""

    def __init__(self, tp: int, cost, oracle: TokenOracle, page_size: int):
        self.tp, self.cost, self.oracle, self.page_size = tp, cost, oracle, page_size
        self.seconds = 0.0                    # device time of the step being launched
        self.prefill_s = self.decode_s = 0.0
        self.prefill_tokens = self.decode_steps = 0

    def prefill(self, weights, kv, b: PrefillBatch):
        n = len(b.seqs)
        s = float(self.cost.prefill_s(self.tp, b.start[:n], b.n_valid[:n]))
        self.seconds += s
        self.prefill_s += s
        self.prefill_tokens += int(b.n_valid[:n].sum())
        return kv

    def decode(self, weights, kv, b: DecodeBatch, prev_tokens=None):
        n = len(b.seqs)
        contexts = b.positions[:n].astype(np.int64) + 1
        s = float(self.cost.decode_s(self.tp, contexts, rows=len(b.tokens), width=b.table.shape[1] * self.page_size))
        self.seconds += s
        self.decode_s += s
        self.decode_steps += 1
        tok = np.fromiter((self.oracle.token(q.rid, step) for q, (_, _, step) in zip(b.seqs, b.sampling)),
                          np.int32, n)
        return tok, np.zeros(n, np.float32), kv


class SimInstance(Instance):
    """An `Instance` (its launch/collect/detach code unchanged) over a `SimKV` and a `SimExecutor`."""

    def __init__(self, index: int, cfg: ModelConfig, devices: list[int], *, cost, oracle: TokenOracle,
                 num_pages: int, page_size: int, max_batch: int, max_seq_len: int, prefill_chunk: int,
                 prefill_tokens: int, prefix_sharing: bool, overlap: bool, batch_buckets_per_octave: int,
                 page_buckets: int, order: str):
        self.index, self.cfg, self.devices, self.weights, self.mesh = index, cfg, list(devices), None, None
        self.layout = Layout(tp=len(devices))
        self.shapes = ShapeBuckets.build(max_batch=max_batch, max_seq_len=max_seq_len, page_size=page_size,
                                         prefill_chunk=prefill_chunk, prefill_tokens=prefill_tokens,
                                         per_octave=batch_buckets_per_octave, page_buckets=page_buckets)
        self.sched = Scheduler(num_pages, page_size, max_batch=max_batch, prefill_chunk=prefill_chunk,
                               prefill_tokens=prefill_tokens, prefix_sharing=prefix_sharing, shapes=self.shapes,
                               order=order)
        self.kv = SimKV(self.layout.tp)
        self.executor = SimExecutor(self.layout.tp, cost, oracle, page_size)
        self.overlap = overlap
        self.external: set[int] = set()
        self.busy_s = 0.0
        self._inflight = deque()
        self._dispatched = False
        self._ready = []
        self.overlapped = 0

    def warm(self, *, truncate=(False,), export: bool = False) -> int:
        return 0


class SimService(RolloutService):
    """A `RolloutService` of `SimInstance`s on `devices` virtual devices (see the module docstring).

    `lengths(prompt, params) -> [response length per sample]` is asked once per `add`; `cost` is a
    `jaxrl.sim.cost` model; `timeline` (optional) receives each instance's busy spans as pool "gen<i>"."""

    def __init__(self, cfg: ModelConfig, cost, clock: Clock, *, devices: int,
                 lengths: Callable[[list[int], SamplingParams], Seq[int]], tp: int | Seq[int] = 1,
                 instances: int | None = None, num_pages: int | None = None, page_size: int = 16,
                 max_batch: int = 64, max_seq_len: int = 1024, prefill_chunk: int = 256, prefill_tokens: int = 8192,
                 prefix_sharing: bool = True, router: str = "least_loaded", overlap: bool = True,
                 batch_buckets_per_octave: int = 2, page_buckets: int = 4, order: str = "fcfs",
                 timeline: Timeline | None = None, host_step_s: float = 0.0):
        if router not in ROUTERS:
            raise ValueError(f"router={router!r}; valid choices: {', '.join(ROUTERS)}")
        self.cfg, self.router, self.max_seq_len = cfg, router, max_seq_len
        self.cost, self.clock, self.timeline, self.host_step_s = cost, clock, timeline, float(host_step_s)
        self.devices = list(range(int(devices)))
        self.lengths = lengths
        self.oracle = TokenOracle(cfg.vocab_size)
        self.memory = dict(num_pages=num_pages, page_size=page_size, max_batch=max_batch, max_seq_len=max_seq_len)
        self.instance_kw = dict(page_size=page_size, max_seq_len=max_seq_len, prefill_chunk=prefill_chunk,
                                prefill_tokens=prefill_tokens, prefix_sharing=prefix_sharing, overlap=overlap,
                                batch_buckets_per_octave=batch_buckets_per_octave, page_buckets=page_buckets,
                                order=order, attention_impl="xla")
        self.instances = [self.build_instance(i, g, None, max_batch=max_batch)
                          for i, g in enumerate(plan_layout(tp, instances, self.devices))]
        self._ids, self._groups, self._rr = itertools.count(), itertools.count(), itertools.count()
        self._where, self._ready = {}, []
        self.version, self._versions = 0, {}        # (RolloutService's per-token weights versions)
        self.adaptive = None
        self.observers = []
        self.steps = 0
        self.relayouts: list[migration.RelayoutReport] = []
        self.retired_preemptions = 0            # counted by instances a relayout replaced

    # ------------------------------------------------------------------ construction
    def build_instance(self, index: int, mesh, weights, *, max_batch: int, num_pages: int | None = None) -> SimInstance:
        """`mesh` is the instance's device group (virtual device ids). Pages: `num_pages`, else the
        service's, else the cost model's budget for this TP (`cost.pages`)."""
        devices = list(mesh)
        kw = {k: v for k, v in self.instance_kw.items() if k != "attention_impl"}
        pages = num_pages or self.memory["num_pages"] or self.cost.pages(
            self.cfg, len(devices), page_size=kw["page_size"], max_batch=max_batch, max_seq_len=self.max_seq_len)
        # a budget beyond 4x what max_batch full-length sequences hold never binds (a small model on a big GPU
        # would otherwise get tens of millions of pages, whose free list alone takes seconds to build)
        pages = min(int(pages), 4 * max_batch * -(-self.max_seq_len // kw["page_size"]) + 1)
        return SimInstance(index, self.cfg, devices, cost=self.cost, oracle=self.oracle, num_pages=int(pages),
                           max_batch=max_batch, **kw)

    synced = object()     # the "weights" a step's sync hands to `planner.apply` (timed by the step simulator)

    def warm(self, params=(SamplingParams(),)) -> int:
        return 0

    def update_weights(self, weights, *, adapters_only: bool = False) -> list:
        """The weight sync is the step's own stage (timed by the step simulator), not the engine's."""
        return []

    # ------------------------------------------------------------------ requests and steps
    def add(self, prompt, params: SamplingParams = SamplingParams(), *, instance: int | None = None,
            priority: float = 0.0) -> list[int]:
        rids = super().add(prompt, params, instance=instance, priority=priority)
        lengths = list(self.lengths(list(prompt), params))
        if len(lengths) != len(rids):
            raise ValueError(f"lengths() gave {len(lengths)} response lengths for a request of n={len(rids)}")
        for j, (rid, n) in enumerate(zip(rids, lengths)):
            self.oracle.set(rid, n, j)
        return rids

    def _dispatched(self) -> None:
        t0 = self.clock()
        steps, batch = [], []
        for inst in self.instances:
            s, inst.executor.seconds = inst.executor.seconds, 0.0
            if s:
                batch.append(len(inst.sched.running))
            if s and self.timeline is not None:
                for d in inst.devices:
                    self.timeline.add(f"gen{d}", "decode", t0, t0 + s)
            steps.append(s)
        longest = max(steps)
        kappa = self.cost.contention(self.instances[0].tp, float(np.mean(batch))) if len(batch) > 1 else 0.0
        dt = longest + kappa * (sum(steps) - longest)
        if dt:
            self.steps += 1
            self.clock.advance(dt + self.host_step_s)

    # ------------------------------------------------------------------ movable state
    def relayout(self, tp, instances=None, *, kv: str = "migrate", max_batch: int | None = None,
                 num_pages: int | None = None, probe=None, weights=None) -> migration.RelayoutReport:
        """`RolloutService.relayout` on the simulated instances: the same dealing and page mapping
        (`migration.attach_dealt`); the clock advances by the switch's cost (module docstring). With
        `weights` (a weight sync riding the layout change, between steps) only the control overhead is
        charged here: the sync itself is the step's stage."""
        if kv not in KV_MODES:
            raise ValueError(f"kv={kv!r}; valid choices: {', '.join(KV_MODES)}")
        self.pause()
        t0 = self.clock()
        groups = plan_layout(tp, instances, self.devices)
        if max_batch is None:
            max_batch = max(1, sum(i.max_batch for i in self.instances) // len(groups))
        old = self.instances
        states = [inst.detach(inst.live_rids(), keep_kv=kv == "migrate") for inst in old]
        sources = {inst.index: migration.PoolSource(inst.kv, lambda _: None, {p: p for st in sts for p in st.pages})
                   for inst, sts in zip(old, states) if any(st.pages for st in sts)}
        new = [self.build_instance(j, g, None, max_batch=max_batch, num_pages=num_pages) for j, g in enumerate(groups)]
        received = {}

        def count(src_kv, rows, dst_kv, dst):
            sent = len(rows) * self.cost.page_bytes(self.cfg, self.instance_kw["page_size"])
            received[id(dst_kv)] = received.get(id(dst_kv), 0) + sent / self.cost.kv_shards(self.cfg, dst_kv.tp)
            return dst_kv, sent, sent

        everything = sorted((st for sts in states for st in sts), key=lambda st: st.rid)
        rep = migration.attach_dealt(everything, new, sources, kv, mover=count)
        self.instances = new
        self._where = {rid: inst for inst in new for rid in inst.live_rids()}
        self.retired_preemptions += sum(i.sched.preemptions for i in old)
        old_tps, new_tps = [i.tp for i in old], [i.tp for i in new]
        rep.seconds = self.cost.kv_move_s(max(received.values(), default=0.0))
        weight_s = 0.0 if weights is not None or old_tps == new_tps else self.cost.reshard_s(self.cfg, old_tps[0], new_tps[0])
        seconds = rep.seconds + weight_s + self.cost.control_s
        report = migration.RelayoutReport(old_tps, new_tps, len(everything), rep,
                                          0 if weights is not None else self.cost.reshard_bytes(self.cfg, old_tps[0], new_tps[0]),
                                          seconds=seconds, weight_seconds=weight_s)
        if self.timeline is not None and seconds:
            for d in self.devices:
                self.timeline.add(f"gen{d}", "switch", t0, t0 + seconds)
        self.clock.advance(seconds)
        self.relayouts.append(report)
        return report

    # ------------------------------------------------------------------ stats
    def busy(self) -> dict:
        """Decode/prefill seconds and counts summed over the current instances' executors."""
        ex = [i.executor for i in self.instances]
        return {"prefill_s": sum(e.prefill_s for e in ex), "decode_s": sum(e.decode_s for e in ex),
                "prefill_tokens": sum(e.prefill_tokens for e in ex), "decode_steps": sum(e.decode_steps for e in ex)}
