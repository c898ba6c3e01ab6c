"""RolloutService: rollout instances over a device pool, whose live sequences, KV and layout can move.

    svc = RolloutService(cfg, weights, tp=2, instances=4)       # or tp=[4, 2, 2]: one TP4 + two TP2
    ids = svc.add(prompt_tokens, SamplingParams(max_new_tokens=64, temperature=1.0, n=8, seed=1))
    for c in svc.stream():          # each Completion the moment it finishes
        ...
    svc.pause()                                   # drain in-flight steps; every live sequence stays resumable
    states = svc.detach(rids)                     # live sequences leave their instance (KV pages held)
    svc.attach(states, instance=i, kv="migrate")  # or kv="recompute": re-prefill prompt + generated tokens
    svc.relayout(tp=8, instances=1, kv="migrate") # move every live sequence and its KV, reshard the weights
    svc.add(prompt, params, instance=i)           # route to a chosen instance (default: the router)
    svc.update_weights(new_weights)               # layer-wise reshard from any layout
    svc.swap_weights(new_weights, version=3)      # mid-generation: live sequences continue on them (versions per token)
    svc.add_tokens(rid, observation)              # multi-turn: continue a sequence paused at a turn stop

Each instance runs a bounded set of step shapes (`shapes.ShapeBuckets`: decode rows in
`batch_buckets_per_octave` steps per octave, `page_buckets` page-table widths, x4 prefill ladders);
`warm()` compiles the whole set, after which no rollout compiles.

Every `step()` dispatches all instances' work (`Instance.launch`, asynchronous) before reading any
result (`Instance.collect`), so instances on disjoint devices run concurrently; with `overlap` (default)
each instance also reads step n only after dispatching step n+1 (see `instance`). Stepping after a
pause, detach, attach or relayout simply resumes.

Pages per instance come from a per-device memory budget (`memory.pages_for_budget`): `kv_bytes_per_device`
or `kv_memory_fraction` of the device's memory, minus the instance's weight shard on that device, divided
by one page's bytes on a device, so a TP8 instance gets more pages than a TP2 one (when its KV heads shard).
`num_pages` overrides; with neither and no device memory figure (the CPU) the pool holds `max_batch`
sequences of `max_seq_len`.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator, Sequence as Seq

import jax

from jaxrl.runtime import enable_compilation_cache
from models import ModelConfig, Weights, fit_vocab, logical_axes, vocab_rows
from sharding import Layout, ShardingRules, padded_vocab_for, reshard, shardings_for

from . import migration, weight_sync
from .instance import Completion, Instance
from .memory import instance_pages
from .migration import plan_layout
from .params import SamplingParams
from .scheduler import Sequence, SequenceState
from .tp_switch import AdaptiveTP
from .weight_sync import Staged

ROUTERS = ("least_loaded", "round_robin")
ATTENTION_IMPLS = ("xla", "pallas")   # xla: CPU default; pallas: GPU kernels (interpret mode on the CPU)
KV_MODES = ("migrate", "recompute")


def truncate_variants(params: Seq[SamplingParams]) -> tuple[bool, ...]:
    """The sampler variants `params` run: whether top-k/top-p is compiled in."""
    return tuple(sorted({p.temperature > 0 and (p.top_k > 0 or p.top_p < 1) for p in params}))


class RolloutService:
    synced_bytes = 0        # weight bytes the syncs (update_weights, relayout(weights=)) moved, in total
    # A weight sync (an instance's first copy, `update_weights`, a relayout given new weights) moves a stacked leaf
    # of at most this many bytes whole (`sharding.reshard`'s whole_leaf_bytes): at most 4 MiB of transient, and a
    # small model skips the per-layer programs traced and compiled for every instance's devices. A real model's
    # stacked leaves (one 0.6B layer's MLP weight is 6 MB, x 28 layers) still move layer by layer; PAT's relayout
    # from the instances' own copies always does.
    SYNC_WHOLE_LEAF_BYTES = 4 << 20

    def __init__(self, cfg: ModelConfig, weights: Weights, *, tp: int | Seq[int] = 1, instances: int | None = None,
                 devices=None, num_pages: int | None = None, page_size: int = 16, max_batch: int = 64,
                 max_seq_len: int = 1024, kv_bytes_per_device: int | None = None,
                 kv_memory_fraction: float | None = None, prefill_chunk: int = 256, prefill_tokens: int = 8192,
                 kv_dtype=None, prefix_sharing: bool = True, router: str = "least_loaded",
                 attention_impl: str = "xla", overlap: bool = True, batch_buckets_per_octave: int = 2,
                 page_buckets: int = 4, order: str = "fcfs", batch_cap: int | None = None):
        if router not in ROUTERS:
            raise ValueError(f"router={router!r}; valid choices: {', '.join(ROUTERS)}")
        if attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl={attention_impl!r}; valid choices: {', '.join(ATTENTION_IMPLS)}")
        enable_compilation_cache()
        self.cfg, self.router, self.max_seq_len = cfg, router, max_seq_len
        self.batch_cap = batch_cap      # no instance runs more sequences (its step shapes stop there)
        self.devices = list(devices if devices is not None else jax.devices())
        self.memory = dict(num_pages=num_pages, page_size=page_size, max_batch=max_batch, max_seq_len=max_seq_len,
                           kv_bytes_per_device=kv_bytes_per_device, kv_memory_fraction=kv_memory_fraction,
                           kv_dtype=kv_dtype)
        self.instance_kw = dict(page_size=page_size, max_seq_len=max_seq_len, prefill_chunk=prefill_chunk,
                                prefill_tokens=prefill_tokens, kv_dtype=kv_dtype, prefix_sharing=prefix_sharing,
                                attention_impl=attention_impl, overlap=overlap,
                                batch_buckets_per_octave=batch_buckets_per_octave, page_buckets=page_buckets,
                                order=order)
        self.instances: list[Instance] = []
        given = migration.buffers(weights)
        meshes = [Layout(tp=len(g)).make_mesh(g) for g in plan_layout(tp, instances, self.devices)]
        copies = weight_sync.local_copies(self, weights, meshes)
        for i, mesh in enumerate(meshes):
            w, _ = self.place(weights if copies is None else copies[i], mesh,
                              whole_leaf_bytes=self.SYNC_WHOLE_LEAF_BYTES)
            self.instances.append(self.build_instance(i, mesh, w, max_batch=max_batch))
            self.instances[-1].external = migration.buffers(w) & given
        self._ids = itertools.count()
        self._groups = itertools.count()
        self._rr = itertools.count()
        self._where: dict[int, Instance] = {}
        self._ready: list[Completion] = []
        self.version = 0            # the weights version the instances hold; each token records the one that sampled it
        self._versions: dict[int, list[tuple[int, int]]] = {}     # live rid -> [(first token index, version)]
        self.adaptive = None        # PAT (`tp_switch.AdaptiveTP`): may switch the layout after any step
        self.observers: list[Callable[[float, float], None]] = []   # (start, end) of each step (timelines)
        self.clock: Callable[[], float] = time.perf_counter         # what `observers` are given (a simulator's: virtual)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, section, model_cfg: ModelConfig, weights: Weights, *, devices=None,
                    order: str = "fcfs", max_requests: int | None = None) -> RolloutService:
        """The service a `jaxrl.config.generate.EngineSection` describes, holding `weights` (`order`: admission,
        "lpt" for StreamRL's longest-predicted-first), with its PAT driver (`AdaptiveTP.from_config`).
        `max_requests`: the most requests a rollout ever holds at once (the trainer's); each instance's batch is
        capped by it, so none compiles step shapes it can never run (the KV pool is still sized by max_batch)."""
        svc = cls(model_cfg, weights, tp=section.tp, instances=section.instances, devices=devices,
                  page_size=section.page_size, num_pages=section.num_pages,
                  kv_bytes_per_device=section.kv_bytes_per_device, kv_memory_fraction=section.kv_memory_fraction,
                  max_batch=section.max_batch, batch_cap=max_requests,
                  max_seq_len=section.max_seq_len, prefix_sharing=section.prefix_sharing,
                  attention_impl=section.attention_impl, prefill_chunk=section.prefill_chunk,
                  prefill_tokens=section.prefill_tokens, overlap=section.overlap,
                  batch_buckets_per_octave=section.batch_buckets_per_octave, page_buckets=section.page_buckets,
                  order=order)
        svc.adaptive = AdaptiveTP.from_config(section.adaptive_tp, section.num_devices, model_cfg)
        return svc

    def weight_shardings(self, mesh):
        """Rollout shardings of the weights on `mesh`, with the vocabulary padded to a multiple of its tp."""
        layout = Layout(tp=mesh.shape["tp"])
        axes = logical_axes(self.cfg, vocab_size=padded_vocab_for(self.cfg, layout))
        return shardings_for(axes, mesh, ShardingRules.rollout(self.cfg, layout))

    def place(self, weights: Weights, mesh, **reshard_kw):
        """`weights` (any layout, real or padded vocabulary) as the rollout copy of an instance on `mesh`,
        moved layer by layer; returns (weights, `sharding.ReshardReport`). The vocabulary is first padded (or
        cut) to the instance's multiple of tp (`models.fit_vocab`); that fresh copy of embed/lm_head is
        always donated to the reshard."""
        padded = padded_vocab_for(self.cfg, Layout(tp=mesh.shape["tp"]))
        if vocab_rows(weights) != padded:
            donate = reshard_kw.pop("donate", False)
            consumed = donate if callable(donate) else (lambda x: bool(donate))
            fitted = fit_vocab(weights, padded)
            fresh = [x for x in (fitted.embed, fitted.lm_head) if x is not None]
            for old in (weights.embed, weights.lm_head):     # now copied into `fresh`; free them if donated
                if isinstance(old, jax.Array) and consumed(old):
                    old.delete()
            reshard_kw["donate"] = lambda x: any(x is f for f in fresh) or consumed(x)
            weights = fitted
        return reshard(weights, self.weight_shardings(mesh), **reshard_kw)

    def build_instance(self, index: int, mesh, weights, *, max_batch: int, num_pages: int | None = None) -> Instance:
        m = dict(self.memory, max_batch=max_batch)
        if num_pages is not None:
            m["num_pages"] = num_pages
        pages = instance_pages(self.cfg, mesh, weights, **m)     # (the pool as max_batch sizes it, cap or not)
        cap = min(max_batch, self.batch_cap or max_batch)       # (token vector and pool as without the cap)
        return Instance(index, self.cfg, mesh, weights, num_pages=pages, max_batch=cap, token_slots=max_batch,
                        **self.instance_kw)

    # ------------------------------------------------------------------ requests
    def add(self, prompt: Seq[int], params: SamplingParams = SamplingParams(), *, instance: int | None = None,
            priority: float = 0.0) -> list[int]:
        """Queue one prompt (`params.n` samples, kept together so they share prompt pages) on `instance`
        (default: the router's choice). `priority`: the admission key under `order="lpt"` (StreamRL: the
        predicted length; larger first); the tokens never depend on it (per-request seeds)."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("empty prompt")
        if max(prompt) >= self.cfg.vocab_size or min(prompt) < 0:
            raise ValueError(f"prompt token ids must be in [0, {self.cfg.vocab_size})")
        if len(prompt) + params.max_new_tokens > self.max_seq_len:
            raise ValueError(f"prompt {len(prompt)} + max_new_tokens {params.max_new_tokens} = "
                             f"{len(prompt) + params.max_new_tokens} tokens > engine.max_seq_len={self.max_seq_len}; "
                             "raise engine.max_seq_len or shorten the prompt")
        group = next(self._groups) if params.n > 1 else None
        seqs = []
        for j in range(params.n):
            rid = next(self._ids)
            seqs.append(Sequence(rid, prompt, params, seed=(params.seed * 1_000_003 + j) % 2**32, group=group,
                                 priority=float(priority)))
        inst = self._instance(instance)
        inst.add(seqs)
        for s in seqs:
            self._where[s.rid] = inst
            self._versions[s.rid] = [(0, self.version)]
        return [s.rid for s in seqs]

    def resume(self, prompt: Seq[int], params: SamplingParams, *, seed: int, tokens: Seq[int], logprobs: Seq[float],
               versions: Seq[tuple[int, int]], instance: int | None = None, priority: float = 0.0) -> int:
        """A response generated earlier, perhaps by other weights (a carried partial response,
        `partial_carry`), continues as a new request: `tokens` (with their `logprobs`) are its first outputs,
        prompt + tokens are prefilled on the weights held now, and sampling goes on at position len(tokens)
        with the sample's own `seed`, so it samples what the request would have sampled there on these
        weights. `versions`: the tokens' (first index, version) spans; the tokens from here on record the
        version held now. Returns the new request id."""
        if len(tokens) != len(logprobs) or not tokens or len(tokens) >= params.max_new_tokens:
            raise ValueError(f"resume: {len(tokens)} tokens and {len(logprobs)} log-probs (need 1 .. "
                             f"max_new_tokens-1 = {params.max_new_tokens - 1} of each)")
        rid = next(self._ids)
        st = SequenceState(rid, tuple(int(t) for t in prompt), dataclasses.replace(params, n=1), int(seed), None,
                           tuple(int(t) for t in tokens), tuple(float(x) for x in logprobs),
                           priority=float(priority))
        self.attach([st], instance=instance, kv="recompute")
        self._versions[rid] = [*map(tuple, versions), (len(tokens), self.version)]
        return rid

    def warm(self, params: Seq[SamplingParams] = (SamplingParams(),), *, cover: bool = False) -> int:
        """Compile, on every instance, each step shape it can run (its bounded `ShapeBuckets`) with the
        sampler variants `params` need (whether top-k/top-p is compiled in), and the K/V export of every
        page-count bucket when some params have `return_kv`; returns the number of new
        executables. Afterwards rollouts with such params compile nothing (instances rebuilt on the same
        layout reuse the executables). `cover`: only each kind's cover shape, every step rounded up to it
        until the instances' `use_exact()` (`Instance.warm`; `jaxrl.train.background`)."""
        export = any(p.return_kv for p in params)
        return sum(inst.warm(truncate=truncate_variants(params), export=export, cover=cover) for inst in self.instances)

    def _instance(self, index: int | None) -> Instance:
        if index is not None:
            if not 0 <= index < len(self.instances):
                raise ValueError(f"instance={index}: the service has instances 0..{len(self.instances) - 1}")
            return self.instances[index]
        if self.router == "round_robin":
            return self.instances[next(self._rr) % len(self.instances)]
        return min(self.instances, key=lambda i: (i.load, i.index))

    def set_batch_caps(self, caps: Seq[int | None]):
        """Per instance, run at most caps[i] sequences at once (None: its max_batch). No new step shapes:
        a cap only limits admission (StreamRL: small batches on the long-tail instances). A relayout
        builds instances without caps."""
        if len(caps) != len(self.instances):
            raise ValueError(f"{len(caps)} batch caps for {len(self.instances)} instances")
        for inst, cap in zip(self.instances, caps):
            inst.sched.set_batch_cap(inst.max_batch if cap is None else int(cap))

    def abort(self, rid: int) -> Completion | None:
        """Remove a request at once and free its pages; returns its partial completion (None if unknown)."""
        inst = self._where.pop(rid, None)
        s = inst.abort(rid) if inst else None
        if s is None:
            return None
        return self._stamp(Completion(s.rid, s.prompt, s.out, s.logprobs, "abort", inst.index, s.preemptions,
                                      appended=s.appended))

    def _stamp(self, c: Completion) -> Completion:
        """`c.versions` from the request's record (kept while it is paused at a turn stop)."""
        spans = self._versions.get(c.request_id, [])
        c.versions = [span for span in spans if span[0] < len(c.tokens)] or spans[:1]
        if c.finish_reason != "turn":
            self._versions.pop(c.request_id, None)
        return c

    # ------------------------------------------------------------------ multi-turn
    def add_tokens(self, rid: int, tokens: Seq[int]) -> None:
        """Continue request `rid`, paused at one of its `turn_stops` (its completion came out with
        finish_reason "turn"), with `tokens` appended: an observation the model did not sample (a tool's
        output, a user message). Its KV is kept, so the next step prefills only the appended tokens and
        generation resumes where it stopped; greedy tokens equal a fresh prefill of the whole conversation.
        The appended span is marked in the completion (`Completion.appended`). The tokens after the prompt,
        appended ones included, stay within `max_new_tokens`."""
        inst = self._where.get(rid)
        if inst is None:
            raise KeyError(f"request {rid} is not live (finished, aborted or never added)")
        tokens = [int(t) for t in tokens]
        if tokens and (max(tokens) >= self.cfg.vocab_size or min(tokens) < 0):
            raise ValueError(f"appended token ids must be in [0, {self.cfg.vocab_size})")
        inst.add_tokens(rid, tokens)

    def finish(self, rid: int) -> Completion:
        """End request `rid`'s trajectory while it is paused at a turn stop: returns its final completion
        (finish_reason "stop", `kv` with `return_kv`) and its KV pages are freed."""
        inst = self._where.get(rid)
        if inst is None:
            raise KeyError(f"request {rid} is not live (finished, aborted or never added)")
        c = inst.finish(rid)
        del self._where[rid]
        return self._stamp(c)

    def has_work(self) -> bool:
        return bool(self._ready) or any(i.has_work() for i in self.instances)

    def step(self) -> list[Completion]:
        t0 = self.clock()
        for inst in self.instances:                              # dispatch everything first
            inst.launch()
        self._dispatched()
        done, self._ready = self._ready, []
        done += [c for inst in self.instances for c in inst.collect()]
        for c in done:
            if c.finish_reason != "turn":             # (a paused sequence stays where it is)
                self._where.pop(c.request_id, None)
            self._stamp(c)
        if self.adaptive is not None:
            self.adaptive.after_step(self)
        for f in self.observers:
            f(t0, self.clock())
        return done

    def _dispatched(self) -> None:
        """Called once every instance has dispatched its step (the simulator advances its clock here)."""

    def stream(self) -> Iterator[Completion]:
        """Run until idle, yielding each completion as soon as it finishes."""
        while self.has_work():
            yield from self.step()

    def run(self) -> list[Completion]:
        """Run until idle; completions ordered by request id."""
        return sorted(self.stream(), key=lambda c: c.request_id)

    # ------------------------------------------------------------------ movable state
    def pause(self):
        """Drain every in-flight step; completions found meanwhile come out of the next `step`."""
        for inst in self.instances:
            inst.pause()
            self._ready += inst.collect()

    def live(self) -> list[int]:
        """Request ids of every live (waiting or running) sequence."""
        return [rid for inst in self.instances for rid in inst.live_rids()]

    def detach(self, rids: Seq[int], *, keep_kv: bool = True) -> list[SequenceState]:
        """Live sequences leave their instances (pausing first). With `keep_kv` their pages stay held on
        the source instance until `attach` moves (or drops) them; every state says where its KV lives."""
        self.pause()
        states = []
        for rid in rids:
            inst = self._where.get(rid)
            if inst is None:
                raise KeyError(f"request {rid} is not live")
            states += inst.detach([rid], keep_kv=keep_kv)
            del self._where[rid]
        return states

    def attach(self, states: Seq[SequenceState], *, instance: int | None = None,
               kv: str = "migrate") -> migration.MoveReport:
        """Sequences join `instance` (default: the router). kv="migrate" copies their valid KV pages layer by
        layer into its pool (a group's shared prompt pages once, sharing kept; sequences whose pages do not
        fit recompute instead); kv="recompute" drops the KV and re-prefills prompt + generated tokens. The
        source pages are released either way. Sampling continues at each state's own position."""
        if kv not in KV_MODES:
            raise ValueError(f"kv={kv!r}; valid choices: {', '.join(KV_MODES)}")
        target = self._instance(instance)
        sources = {i.index: migration.PoolSource(i.kv, i.sched.release) for i in self.instances}
        report = migration.attach(list(states), target, sources, kv)
        for st in states:
            self._where[st.rid] = target
        return report

    def relayout(self, tp: int | Seq[int], instances: int | None = None, *, kv: str = "migrate",
                 max_batch: int | None = None, num_pages: int | None = None,
                 probe: Callable[[], None] | None = None, weights: Weights | None = None,
                 classes=None) -> migration.RelayoutReport:
        """Switch the instances to a new layout mid-generation: pause, move every live sequence and its KV,
        reshard the weights layer by layer from the rollout copy, and resume (see `migration.relayout`).
        `max_batch` per new instance defaults to keeping the batch per device (old total / new count on the
        same devices; a layout over more devices, StreamRL's scale-up, holds proportionally more). `weights`: take
        the new instances' weights from these (this process's arrays) instead: a weight sync and a layout
        change in one reshard (RollPacker's planner between steps). `classes` (`skew.Classes` on the new
        instances): StreamRL's long/regular classes, each dealt over its own instances (PAT keeps them)."""
        if kv not in KV_MODES:
            raise ValueError(f"kv={kv!r}; valid choices: {', '.join(KV_MODES)}")
        self.pause()
        t0 = time.perf_counter()
        groups = plan_layout(tp, instances, self.devices)
        if max_batch is None:       # (the batch the instances were sized for, before a cap, per device they use)
            total = sum(getattr(i, "pool_batch", i.max_batch) for i in self.instances)
            used, new_used = sum(i.tp for i in self.instances), sum(len(g) for g in groups)
            max_batch = max(1, total * new_used // (used * len(groups)))
        new, report = migration.relayout(self, groups, kv=kv, max_batch=max_batch, num_pages=num_pages, probe=probe,
                                         weights=weights, classes=classes)
        self.instances = new
        self._where = {rid: inst for inst in new for rid in inst.live_rids()}
        if weights is not None:
            self.synced_bytes += report.weight_bytes
        report.seconds = time.perf_counter() - t0
        return report

    def swap_weights(self, weights: Weights, version: int, *, kv: str = "keep", adapters_only: bool = False,
                     staged: Staged | None = None) -> dict:
        """A weight update in the middle of generation: live sequences continue on `weights`, their tokens from
        now on recording `version`; kv="keep" or "recompute" (`weight_sync.swap_weights`)."""
        return weight_sync.swap_weights(self, weights, version, kv=kv, adapters_only=adapters_only, staged=staged)

    def stage(self, weights: Weights, *, adapters_only: bool = False) -> Staged:
        """The collective half of a sync (multi-process), run at the same point on every process
        (`weight_sync.stage`)."""
        return weight_sync.stage(self, weights, adapters_only=adapters_only)

    def update_weights(self, weights: Weights, *, adapters_only: bool = False, version: int | None = None,
                       staged: Staged | None = None) -> list:
        """Reshard `weights` (any layout) into every instance, layer by layer; returns the reports
        (`weight_sync.update_weights`)."""
        return weight_sync.update_weights(self, weights, adapters_only=adapters_only, version=version,
                                          staged=staged)

    # ------------------------------------------------------------------ stats
    def stats(self) -> list[dict]:
        return [i.stats() for i in self.instances]

    def sequence_stats(self) -> list[dict]:
        """One row per live sequence: request_id, instance, state (running/waiting), context_len,
        prompt_len, generated, group, pages, preemptions, max_new_tokens."""
        return [row for i in self.instances for row in i.sequence_stats()]

    @property
    def layout(self) -> list[int]:
        """TP size of each instance, in order."""
        return [i.tp for i in self.instances]


def generate(cfg: ModelConfig, weights: Weights, prompts: Seq[Seq[int]], params: SamplingParams = SamplingParams(),
             *, tp: int | Seq[int] = 1, instances: int | None = None, **service_kw) -> list[Completion]:
    """Generate for every prompt; returns completions in prompt order (`params.n` per prompt, adjacent)."""
    svc = RolloutService(cfg, weights, tp=tp, instances=instances, **service_kw)
    order = [rid for p in prompts for rid in svc.add(p, params)]
    by_id = {c.request_id: c for c in svc.stream()}
    return [by_id[r] for r in order]
