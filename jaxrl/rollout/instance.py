"""One rollout instance: a TP group on its own sub-mesh, made of three parts that can be taken apart.

  scheduler  `Scheduler`  host-side, pure Python: admission, pages, sharing, preemption, retirement;
                          its sequences leave and join as `SequenceState` values
  KV store   `KVStore`    the paged K/V pool, a pytree sharded by the rollout rules of this layout
  executor   `Executor`   the compiled prefill/decode steps, from an explicit executable cache

Per `launch()`: admit and prefill (one batched call for every admitted prompt), fork shared prompt
pages, make sure every running sequence owns its next page (preempting when the pool is empty), then
dispatch one decode step, never waiting for the device. `collect()` reads a step back, appends the
tokens and retires finished sequences at once. A service dispatches every instance before collecting.

Overlap (default): step n+1 is dispatched before step n's tokens are read. Its input tokens are step
n's device outputs (fed inside `model_step.decode_step`), its pages are reserved one position ahead, and the host
reads step n while the device runs n+1, so the host's scheduling time hides behind device time. A
sequence that stops at step n has computed one extra token in n+1; it is discarded (its K/V went to the
sequence's own page, freed afterwards; the device orders the later reuse). Sequences whose in-flight
token ends them by length are left out of n+1. Preemption drains the in-flight step first, so victims
never have unread tokens. `overlap=False` reads every step before the next dispatch. `pause()` drains
every in-flight step, after which every live sequence can be detached.

Simplification (stated): prefill runs to completion inside `launch` before the decode dispatch
rather than being mixed into decode batches chunk by chunk.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import deque

import jax
import numpy as np

from models import ModelConfig
from sharding import Layout, ShardingRules

from .executor import CACHE, Executor, abstract
from .kv_store import KVStore, SequenceKV
from .scheduler import Scheduler, Sequence, SequenceState
from .shapes import ShapeBuckets


@dataclasses.dataclass
class Completion:
    request_id: int
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str                    # "stop" | "length" | "abort" | "turn" (paused at a turn stop)
    instance: int
    preemptions: int = 0
    kv: SequenceKV | None = None          # return_kv: K/V on the instance's devices (`.numpy()` for host copies)
    appended: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # observation spans of `tokens`
    versions: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (first token index, weights version)

    def token_versions(self, default: int = 0) -> list[int]:
        """The weights version that sampled each of `tokens` (`RolloutService.swap_weights`: a sequence may
        span several; `default` where none was recorded); an appended (observation) token carries the version
        current when it was appended."""
        spans = self.versions or [(0, default)]
        out, k = [], 0
        for i in range(len(self.tokens)):
            while k + 1 < len(spans) and spans[k + 1][0] <= i:
                k += 1
            out.append(spans[k][1])
        return out

    def sampled_mask(self) -> list[int]:
        """1 for each token of `tokens` the model sampled, 0 for an appended (observation) one."""
        mask = [1] * len(self.tokens)
        for a, b in self.appended:
            mask[a:b] = [0] * (b - a)
        return mask


class Instance:
    def __init__(self, index: int, cfg: ModelConfig, mesh, weights, *, num_pages: int, page_size: int = 16,
                 max_batch: int = 64, max_seq_len: int | None = None, prefill_chunk: int = 256,
                 prefill_tokens: int = 8192, kv_dtype=None, prefix_sharing: bool = True, attention_impl: str = "xla",
                 overlap: bool = True, batch_buckets_per_octave: int = 2, page_buckets: int = 4, order: str = "fcfs",
                 token_slots: int | None = None):
        """`token_slots` (>= max_batch; default max_batch): the batch the instance's pool and decode token vector
        were sized for before a cap (`RolloutService(batch_cap=)`); the token vector is part of every decode
        executable's signature, so instances with other caps share executables, and a relayout sizes its
        instances from it (`pool_batch`), not from the capped max_batch."""
        self.pool_batch = max(max_batch, token_slots or max_batch)
        self.index, self.cfg, self.mesh, self.weights = index, cfg, mesh, weights
        self.layout = Layout(tp=mesh.shape["tp"])
        self.shapes = ShapeBuckets.build(max_batch=max_batch, max_seq_len=max_seq_len or (num_pages - 1) * page_size,
                                         page_size=page_size, prefill_chunk=prefill_chunk,
                                         prefill_tokens=prefill_tokens, per_octave=batch_buckets_per_octave,
                                         page_buckets=page_buckets)
        self.sched = Scheduler(num_pages, page_size, max_batch=max_batch, prefill_chunk=prefill_chunk,
                               prefill_tokens=prefill_tokens, prefix_sharing=prefix_sharing, shapes=self.shapes,
                               order=order)
        dtype = kv_dtype or jax.tree.leaves(weights)[0].dtype
        self.kv = KVStore.allocate(cfg, mesh, ShardingRules.rollout(cfg, self.layout), num_pages, page_size, dtype)
        self.executor = Executor(cfg, mesh, max_batch=self.pool_batch, attention_impl=attention_impl)
        self.overlap = overlap
        self.external: set[int] = set()    # weight buffers shared with arrays the caller owns: never free them
        self.busy_s = 0.0
        self._inflight: deque = deque()   # dispatched decode steps (batch, tokens, logprobs), oldest first
        self._dispatched = False           # whether the latest launch dispatched a step
        self._ready: list[Completion] = []  # completions found while draining inside launch
        self.overlapped = 0                 # steps dispatched while the previous one was still unread

    @property
    def pool(self):
        return self.sched.pool

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def max_batch(self) -> int:
        return self.sched.max_batch

    # ------------------------------------------------------------------ requests
    def add(self, seqs: list[Sequence]):
        self.sched.add(seqs)

    def abort(self, rid: int) -> Sequence | None:
        s = self.sched.find(rid)
        if s is not None:
            self.sched.remove(s)
        return s

    @property
    def load(self) -> int:
        return self.sched.load

    def has_work(self) -> bool:
        """Whether stepping would make progress (a sequence paused between turns waits for `add_tokens`)."""
        return bool(self.sched.waiting or self.sched.running or self._inflight or self._ready)

    def add_tokens(self, rid: int, tokens) -> None:
        """Continue paused sequence `rid` with `tokens` appended (`Scheduler.resume`); a step of it still in
        flight (overlap) is read back first."""
        s = self.sched.find(rid)
        if s is None or not s.paused:
            raise KeyError(f"request {rid} is not paused at a turn stop on instance {self.index}")
        if s.pending:
            self.pause()
        self.sched.resume(s, tokens)

    def finish(self, rid: int) -> Completion:
        """End paused sequence `rid`'s trajectory: its final completion (finish_reason "stop"; its K/V exported
        with `return_kv` while the pages still hold it: a paused sequence whose KV was evicted has none) and its
        pages return to the pool."""
        s = self.sched.find(rid)
        if s is None or not s.paused:
            raise KeyError(f"request {rid} is not paused at a turn stop on instance {self.index}")
        if s.pending:
            self.pause()
        kv = self.kv.export(s.pages, len(s) - 1) if s.params.return_kv and s.computed >= len(s) - 1 else None
        self.sched.remove(s)
        return Completion(s.rid, s.prompt, s.out, s.logprobs, "stop", self.index, s.preemptions, kv, s.appended)

    # ------------------------------------------------------------------ steps
    def warm(self, *, truncate=(False,), export: bool = False, cover: bool = False) -> int:
        """Compile every step shape this instance can run (`self.shapes`: decode, prefill, page copies),
        for each sampler variant in `truncate`, and with `export` the K/V export of every page-count bucket
        (`return_kv`); returns how many executables that compiled (0 when they are all cached; exports are
        not counted: they are plain jitted functions). Afterwards no rollout on this instance compiles.
        `cover`: only the cover shapes, and every step rounds up to them (`ShapeBuckets.coarse`) until
        `use_exact()`; `compile_exact` compiles the rest meanwhile (on another thread)."""
        before = CACHE.compiles
        if export:
            self.kv.warm_export(self.shapes.max_pages)
        sh = self.shapes
        if cover:
            self.use_shapes(dataclasses.replace(sh, coarse=True))
        decode, prefill = (sh.cover_decode_shapes(), sh.cover_prefill_shapes()) if cover else \
            (sh.decode_shapes(), sh.prefill_shapes())
        self.kv = self.executor.warm(self.weights, self.kv, decode=decode, prefill=prefill, truncate=truncate)
        for n in sh.copy_shapes(self.max_batch):     # copy-on-write of shared prompt pages: scratch -> scratch
            self.kv = self.kv.copy_pages([(0, 0)] * n)
        return CACHE.compiles - before

    def compile_jobs(self, truncate=(False,), *, cover: bool = False) -> list:
        """One job per decode and prefill shape of the exact buckets (`cover`: only the cover shapes, what
        `warm(cover=True)` then runs): job(stop=None) compiles that shape (nothing runs) from abstract inputs
        taken now (the rollout meanwhile donates its K/V), unless `stop` (a threading.Event) is set; returns
        1 if it was new. Any thread may run them (`jaxrl.train.background`)."""
        sh = self.shapes.exact()
        w, kv = abstract(self.weights), KVStore(abstract(self.kv.k), abstract(self.kv.v))
        decode, prefill = (sh.cover_decode_shapes(), sh.cover_prefill_shapes()) if cover else \
            (sh.decode_shapes(), sh.prefill_shapes())
        ex = self.executor

        def job(stop=None, **shape) -> int:
            return 0 if stop is not None and stop.is_set() else ex.compile_all(w, kv, workers=1, **shape)
        return [functools.partial(job, decode=[d], truncate=truncate) for d in decode] + \
            [functools.partial(job, prefill=[p]) for p in prefill]

    def compile_exact(self, truncate=(False,), stop=None, *, cover: bool = False) -> int:
        """`compile_jobs` one after another in the calling thread; returns how many were new."""
        return sum(job(stop=stop) for job in self.compile_jobs(truncate, cover=cover))

    def use_shapes(self, shapes: ShapeBuckets) -> None:
        self.shapes = self.sched.shapes = shapes

    def use_exact(self) -> None:
        """Every later step on its exact bucket (after a `warm(cover=True)`)."""
        self.use_shapes(self.shapes.exact())

    def _drain(self):
        while self._inflight:
            self._ready += self._read(self._inflight.popleft())

    def pause(self):
        """Read back every dispatched step: nothing stays in flight, every live sequence is resumable."""
        self._drain()
        self._dispatched = False

    def launch(self) -> bool:
        """Admit, prefill, dispatch one decode step (never waits for the device). Returns whether a
        step was dispatched."""
        t0 = time.perf_counter()
        groups = self.sched.admit()
        for b in self.sched.prefill_batches([g[0] for g in groups]):   # one batched call per chunk
            self.kv = self.executor.prefill(self.weights, self.kv, b)
        self.kv = self.kv.copy_pages([c for g in groups if len(g) > 1 for c in self.sched.fork(g)])
        self.sched.start(groups)
        if self.sched.shortfall() and self._inflight:
            self._drain()                  # preemption only ever sees sequences with nothing in flight
        self.sched.ensure_pages()
        prev = self._inflight[-1] if self._inflight else None
        batch = self.sched.decode_batch(prev[0].seqs if prev else None)
        self._dispatched = batch is not None
        if batch is None:
            return False
        tok, logp, self.kv = self.executor.decode(self.weights, self.kv, batch, prev[1] if prev else None)
        self.overlapped += bool(self._inflight)
        self._inflight.append((batch, tok, logp))
        self.busy_s += time.perf_counter() - t0
        return True

    def collect(self) -> list[Completion]:
        """Read back the oldest dispatched step unless overlapping it with the one just dispatched;
        returns the sequences that finished."""
        done, self._ready = self._ready, []
        if self._inflight and (len(self._inflight) > 1 or not self._dispatched or not self.overlap):
            done += self._read(self._inflight.popleft())
        return done

    def _read(self, handle) -> list[Completion]:
        batch, tok, logp = handle
        t1 = time.perf_counter()
        tok, logp = np.asarray(tok), np.asarray(logp)
        self.busy_s += time.perf_counter() - t1
        return [self._retire(s, reason) for s, reason in self.sched.take_tokens(batch.seqs, tok, logp)]

    def _retire(self, s: Sequence, reason: str) -> Completion:
        if reason == "turn":              # paused, pages kept: a snapshot of the trajectory so far
            return Completion(s.rid, s.prompt, list(s.out), list(s.logprobs), reason, self.index, s.preemptions,
                              appended=list(s.appended))
        kv = self.kv.export(s.pages, len(s) - 1) if s.params.return_kv else None
        self.sched.retire(s)
        return Completion(s.rid, s.prompt, s.out, s.logprobs, reason, self.index, s.preemptions, kv, s.appended)

    # ------------------------------------------------------------------ movable state
    def detach(self, rids, *, keep_kv: bool = True) -> list[SequenceState]:
        """Live sequences leave (call `pause` first). With `keep_kv` their pages stay held here until
        `release`d (after the KV was moved); the states say which pages."""
        return self.sched.detach(rids, keep_kv=keep_kv, instance=self.index)

    def live_rids(self) -> list[int]:
        return [s.rid for s in self.sched.live]

    def sequence_stats(self) -> list[dict]:
        """Per live sequence: where it is and how long it is (what schedulers and PAT's predictor read)."""
        rows = []
        for state, seqs in (("running", self.sched.running), ("waiting", self.sched.waiting),
                            ("paused", self.sched.paused)):
            for s in seqs:
                rows.append({"request_id": s.rid, "instance": self.index, "state": state, "context_len": len(s),
                             "prompt_len": len(s.prompt), "generated": len(s.out), "group": s.group,
                             "pages": len(s.pages), "preemptions": s.preemptions,
                             "max_new_tokens": s.params.max_new_tokens})
        return rows

    def stats(self) -> dict:
        sc = self.sched
        return {"instance": self.index, "tp": self.tp, "active_batch": len(sc.running),
                "waiting": len(sc.waiting), "paused": len(sc.paused), "prefilled_tokens": sc.prefilled,
                "context_tokens": sum(len(s) for s in sc.running),
                "pages_used": sc.pool.used, "pages_total": sc.pool.capacity, "preemptions": sc.preemptions,
                "generated_tokens": sc.generated, "overlapped_steps": self.overlapped,
                "tokens_per_s": sc.generated / self.busy_s if self.busy_s else 0.0}
