"""Compile a layout's small decode buckets ahead, in a background thread (PAT beyond the paper).

PAT's engine re-captures CUDA graphs after a switch only for the small batch sizes the tail phase can have
(paper §5: 3.59 s -> 0.73 s); a cold switch still pays for them. Here, the first time the controller
evaluates a candidate layout it has not run (`tp_switch.AdaptiveTP`), `Precompiler.request` starts a daemon
thread that compiles that layout's decode executables for the rows buckets up to `fraction` of its
instances' max batch (every page-table width, the live sampler variants), into the process-wide
`executor.CACHE`, from abstract inputs only: `jax.ShapeDtypeStruct`s with the target meshes' shardings, so
nothing is allocated on the devices and the rollout keeps running. A switch whose merged batch fits the
compiled buckets then compiles no decode step, and the controller counts that layout's compile cost as 0
(`ready`). A switch before the thread is done waits only for the executables it uses (the cache never
compiles one key twice), and one with a larger batch compiles the rest as usual.

Not compiled ahead (stated): the prefill executables a `kv=recompute` switch re-prefills with, the KV
staging and the weight slices of the switch itself. On the 2-core CPU the thread competes with decoding
for the cores; on a GPU host compilation runs on otherwise idle CPU cores.
"""

from __future__ import annotations

import logging
import math
import threading
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import models
from models import kv_cache_spec
from sharding import Layout, ShardingRules, padded_vocab_for, shardings_for

from . import model_step
from .executor import CACHE, ExecutableCache, decode_inputs, padding_batch
from .memory import instance_pages
from .migration import plan_layout
from .shapes import ShapeBuckets

log = logging.getLogger(__name__)


def _sds(shape, dtype, sharding):
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def target_plan(svc, tp: int) -> list[dict]:
    """Per instance of a uniform TP-`tp` layout of `svc`'s pool, as `svc.relayout(tp)` would build it: the
    mesh, the abstract weights and KV pool (with their shardings), and the step shapes."""
    groups = plan_layout(tp, len(svc.devices) // tp, svc.devices)
    max_batch = max(1, sum(getattr(i, "pool_batch", i.max_batch) for i in svc.instances) // len(groups))
    cap = min(max_batch, getattr(svc, "batch_cap", None) or max_batch)       # as `RolloutService.build_instance`
    cfg, kw = svc.cfg, svc.instance_kw
    current = svc.instances[0].weights
    abstract = models.abstract(svc.cfg, vocab_size=padded_vocab_for(cfg, Layout(tp=tp)))
    out = []
    for g in groups:
        mesh = Layout(tp=tp).make_mesh(g)
        w = jax.tree.map(lambda x, a, sh: _sds(a.shape, x.dtype, sh), current, abstract, svc.weight_shardings(mesh))
        pages = instance_pages(cfg, mesh, w, **dict(svc.memory, max_batch=max_batch))
        dtype = kw["kv_dtype"] or jax.tree.leaves(current)[0].dtype
        kv_sh = shardings_for(kv_cache_spec(cfg, pages, kw["page_size"], dtype), mesh,
                              ShardingRules.rollout(cfg, Layout(tp=tp)))
        kv_shape = (cfg.num_layers, pages, cfg.num_kv_heads, kw["page_size"], cfg.head_dim)
        shapes = ShapeBuckets.build(max_batch=cap, max_seq_len=kw["max_seq_len"] or (pages - 1) * kw["page_size"],
                                    page_size=kw["page_size"], prefill_chunk=kw["prefill_chunk"],
                                    prefill_tokens=kw["prefill_tokens"], per_octave=kw["batch_buckets_per_octave"],
                                    page_buckets=kw["page_buckets"])
        out.append({"mesh": mesh, "weights": w, "kv": _sds(kv_shape, dtype, kv_sh), "max_batch": max_batch,
                    "shapes": shapes})
    return out


def decode_jobs(svc, plan: list[dict], rows: int, truncate=(False,)) -> list[tuple]:
    """(args, static) of every decode executable with at most `rows` rows (rounded up to a bucket) on the
    planned instances: the exact inputs `Executor.decode` passes, as ShapeDtypeStructs."""
    jobs = []
    for inst in plan:
        rep = NamedSharding(inst["mesh"], PartitionSpec())
        put = lambda x, rep=rep: _sds(np.shape(x), np.asarray(x).dtype, rep)   # noqa: E731
        prev = _sds((inst["max_batch"],), np.int32, rep)
        sh = inst["shapes"]
        bound = sh.batch[min(np.searchsorted(sh.batch, max(rows, 1)), len(sh.batch) - 1)]
        for r in (b for b in sh.batch if b <= bound):
            for p in sh.pages:
                for tr in truncate:
                    args = decode_inputs(inst["weights"], inst["kv"], inst["kv"], prev, padding_batch(r, p, tr), put)
                    jobs.append((args, {"cfg": svc.cfg, "impl": svc.instance_kw["attention_impl"]}))
    return jobs


class Precompiler:
    """Background compiles of candidate layouts' small decode buckets (module docstring)."""

    def __init__(self, fraction: float = 0.25, cache: ExecutableCache = CACHE):
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction={fraction} must be in (0, 1]")
        self.fraction, self.cache = fraction, cache
        self.threads: list[threading.Thread] = []
        self.compiled = 0              # executables the threads compiled (not already cached)
        self.seconds = 0.0             # the threads' wall time
        self._rows: dict[int, int] = {}     # tp -> rows bound requested
        self._done: dict[int, int] = {}     # tp -> rows bound whose executables all exist
        self._lock = threading.Lock()

    def rows_for(self, svc, tp: int) -> int:
        """The rows bound of 'small' for layout `tp`: `fraction` of its instances' max batch."""
        per = max(1, sum(i.max_batch for i in svc.instances) // (len(svc.devices) // tp))
        return max(1, math.ceil(self.fraction * per))

    def request(self, svc, tp: int, truncate=(False,)) -> bool:
        """First sight of layout `tp`: compile its small decode buckets in the background (no-op when already
        requested). Returns whether a thread started."""
        rows = self.rows_for(svc, tp)
        if self._rows.get(tp, 0) >= rows:
            return False
        self._rows[tp] = rows
        jobs = decode_jobs(svc, target_plan(svc, tp), rows, truncate)     # abstract inputs, main thread
        t = threading.Thread(target=self._run, args=(tp, rows, jobs), name=f"precompile-tp{tp}", daemon=True)
        self.threads.append(t)
        t.start()
        log.info("PAT: compiling TP %d's decode buckets up to %d rows in the background (%d executables)",
                 tp, rows, len(jobs))
        return True

    def _run(self, tp: int, rows: int, jobs) -> None:
        t0, n = time.perf_counter(), 0
        try:
            for args, static in jobs:
                if not self.cache.has("decode", model_step.decode_step, *args, **static):
                    self.cache.compile("decode", model_step.decode_step, *args, **static)
                    n += 1
        except Exception as e:          # never break the rollout: the switch compiles what is missing
            log.warning("PAT: background compile of TP %d stopped: %s", tp, e)
            return
        finally:
            with self._lock:
                self.compiled += n
                self.seconds += time.perf_counter() - t0
        with self._lock:
            self._done[tp] = max(self._done.get(tp, 0), rows)

    def ready(self, tp: int, rows: int) -> bool:
        """Whether every decode executable of layout `tp` up to `rows` rows per instance is compiled."""
        with self._lock:
            return self._done.get(tp, 0) >= rows

    def wait(self) -> None:
        for t in self.threads:
            t.join()
