"""The executor of one rollout instance: runs the compiled prefill/decode steps from an explicit cache.

`ExecutableCache` holds ahead-of-time compiled executables (`jit(...).lower(...).compile()`) keyed by
(step, static arguments, the abstract signature of every input: pytree structure, shapes, dtypes and
shardings). The shardings carry the instance's devices and layout, so the key is (layout, batch bucket,
shapes) as ARCHITECTURE.md asks: an instance rebuilt on the same devices and layout (PAT switching back,
a service rebuilt after `relayout`) reuses its executables, and `compiles` / `compile_s` count exactly the
compilations the rollout caused. One process-wide cache (`CACHE`) serves every instance and service.

`Executor.warm(weights, kv, decode=[(rows, pages)], prefill=[(rows, width, pages)])` compiles ahead and
runs each step once on dummy inputs whose every row is padding, so it writes only the scratch page 0;
`Instance.warm` passes it the instance's whole bounded set (`shapes.ShapeBuckets`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import os
import threading
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl.executable_store import ExecutableStore
from models import ModelConfig

from . import model_step
from .kv_store import KVStore
from .params import SamplingParams
from .sampling import SamplingBatch
from .scheduler import DecodeBatch, PrefillBatch


def _axes(entry, mesh):
    """A spec entry without the mesh axes of size 1 (None when nothing is left)."""
    names = tuple(n for n in (entry if isinstance(entry, tuple) else (entry,)) if n is not None and mesh.shape[n] > 1)
    return names or None


def canonical(sharding):
    """One NamedSharding per placement: without the mesh axes of size 1 and trailing Nones (P(None, 'tp')
    and P(None, 'tp', None) are one sharding, so are P('fsdp') and P() when fsdp has size 1), so that a
    sharding passed as a static argument keys the cache as `_signature` keys an input's. Others: as given."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = [_axes(e, sharding.mesh) for e in sharding.spec]
    while spec and spec[-1] is None:
        spec.pop()
    return NamedSharding(sharding.mesh, PartitionSpec(*spec), memory_kind=sharding.memory_kind)


@functools.lru_cache(maxsize=4096)
def _placement(sh, ndim: int):
    """A sharding as `_signature` keys it (memoised: the same few shardings recur every step)."""
    if isinstance(sh, NamedSharding):          # P(None, 'tp') and P(None, 'tp', None) are one sharding,
        spec = tuple(_axes(e, sh.mesh) for e in sh.spec) + (None,) * (ndim - len(sh.spec))
        return sh.mesh, spec, sh.memory_kind   # and so are P('tp') and P() when tp has size 1
    return sh


def _signature(args) -> tuple:
    """An uncommitted array (it goes where its computation goes) is keyed as a ShapeDtypeStruct without a
    sharding: a program lowered for a committed one makes committed outputs, which would then refuse to meet
    arrays on other devices in a later program."""
    leaves, treedef = jax.tree.flatten(args)
    sig = []
    for x in leaves:
        if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
            placed = not isinstance(x, jax.Array) or x.committed
            sig.append((x.shape, x.dtype, _placement(x.sharding, x.ndim) if placed else None))
        else:
            x = np.asarray(x)
            sig.append((x.shape, x.dtype))
    return treedef, tuple(sig)


def abstract(tree):
    """ShapeDtypeStructs of a tree of arrays, keyed (`_signature`) and lowered as the arrays are: with their
    shardings, none for an uncommitted array. What a compilation ahead, or on another thread, reads."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=x.sharding if not isinstance(x, jax.Array) or x.committed else None), tree)


def out_abstract(exe):
    """ShapeDtypeStructs of a compiled executable's outputs, as `abstract` gives its results: with their
    shardings, none where the program makes uncommitted results (one device, nothing placed)."""
    committed = getattr(getattr(exe._executable, "_unloaded_executable", None), "committed", True)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh if committed else None),
                        exe.out_info, exe.output_shardings)


@dataclasses.dataclass
class ExecutableCache:
    """AOT-compiled executables by (name, function, static args, input signature); counts compilations.

    A new entry is first looked for in `jaxrl.executable_store` (`use_store`; the default store, beside the
    persistent cache), which loads it without tracing or lowering, and is written there once compiled.
    `compiles` counts every executable built, loads included (`loads` of them), as JAX's own count of
    compilations counts persistent-cache loads.

    Least-recently-used entries beyond `maxsize` are dropped (and recompiled, counted, if needed again):
    every XLA:CPU executable holds a few memory mappings per device, and a process has a limited number
    (vm.max_map_count), so an unbounded cache eventually makes LLVM abort a later compilation."""

    maxsize: int = 512
    use_store: bool = True
    compiles: int = 0
    loads: int = 0
    compile_s: float = 0.0
    calls: int = 0
    _table: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)
    _pending: dict = dataclasses.field(default_factory=dict)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @staticmethod
    def key(name: str, args, fn=None, **static) -> tuple:
        return name, fn, tuple(sorted(static.items())), _signature(args)

    def compile(self, name: str, fn, *args, **static):
        """The executable of `fn` for these inputs (arrays or ShapeDtypeStructs with shardings), compiled if
        new; nothing runs. `name` labels it (two functions never share an entry). Thread-safe: a key another
        thread is compiling (`precompile`'s background thread) is waited for, not compiled twice."""
        key = self.key(name, args, fn, **static)
        while True:
            with self._lock:
                exe = self._table.get(key)
                if exe is not None:
                    self._table.move_to_end(key)
                    return exe
                busy = self._pending.get(key)
                if busy is None:
                    self._pending[key] = threading.Event()
                    break
            busy.wait()                      # the other thread's result (or its failure: then compile here)
        try:
            t = time.perf_counter()
            store = ExecutableStore.default() if self.use_store else None
            entry = store and store.entry(name, fn, args, static)
            build = lambda: fn.lower(*args, **static).compile()          # noqa: E731
            exe, loaded = entry.load_or_build(build) if entry else (build(), False)
            with self._lock:
                self.compile_s += time.perf_counter() - t
                self.compiles += 1
                self.loads += loaded
                self._table[key] = exe
                while len(self._table) > self.maxsize:
                    self._table.popitem(last=False)
        finally:
            with self._lock:
                self._pending.pop(key).set()
        return exe

    def has(self, name: str, fn, *args, **static) -> bool:
        """Whether these inputs' executable is compiled (nothing is compiled)."""
        with self._lock:
            return self.key(name, args, fn, **static) in self._table

    def __call__(self, name: str, fn, *args, **static):
        exe = self.compile(name, fn, *args, **static)
        self.calls += 1
        return exe(*args)

    def clear(self):
        """Drop every executable (the counters stay)."""
        with self._lock:
            self._table.clear()

    def __len__(self):
        return len(self._table)


CACHE = ExecutableCache()


def padding_batch(rows: int, pages: int, truncate: bool) -> DecodeBatch:
    """A decode batch of `rows` padding rows over a `pages`-wide table (writes only the scratch page), with
    the sampler variant `truncate` (top-k/top-p compiled in or not)."""
    params = SamplingParams(temperature=1.0, top_k=2) if truncate else SamplingParams(temperature=0.0)
    return DecodeBatch([], np.zeros(rows, np.int32), np.zeros(rows, np.int32), np.full(rows, -1, np.int32),
                       np.zeros((rows, pages), np.int32), [(params, 0, 0)])


def decode_inputs(weights, k, v, prev_tokens, b: DecodeBatch, put) -> tuple:
    """The positional inputs of `model_step.decode_step` for batch `b`; `put` places the one packed host
    array (a device put, or a `jax.ShapeDtypeStruct` for compiling ahead: `precompile`)."""
    x = model_step.DecodeInputs.pack(b.src, b.tokens, b.positions, b.table, SamplingBatch.build(b.sampling, len(b.tokens)))
    return (weights, k, v, prev_tokens, model_step.DecodeInputs(put(x.packed), x.truncate))


class Executor:
    """Runs one instance's device steps (prefill, decode) on its mesh through `CACHE`."""

    def __init__(self, cfg: ModelConfig, mesh, *, max_batch: int, attention_impl: str = "xla",
                 cache: ExecutableCache = CACHE):
        self.cfg, self.mesh, self.impl, self.cache, self.max_batch = cfg, mesh, attention_impl, cache, max_batch
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self._zeros = None

    def put(self, x):
        return jax.device_put(x, self.replicated)

    def prefill(self, weights, kv: KVStore, b: PrefillBatch) -> KVStore:
        host = self.put((b.tokens, b.start, b.n_valid, b.table))       # (one batched transfer)
        k, v = self.cache("prefill", model_step.prefill_step, weights, kv.k, kv.v, *host, cfg=self.cfg, impl=self.impl)
        return KVStore(k, v)

    def decode(self, weights, kv: KVStore, b: DecodeBatch, prev_tokens=None):
        """Dispatch one decode step; returns (tokens [max_batch], logprobs [rows], kv) as device arrays
        (nothing is read). `prev_tokens`: the previous step's returned tokens (None: every input token is
        on the host)."""
        if prev_tokens is None:
            prev_tokens = self._no_prev()
        tok, logp, k, v = self.cache("decode", model_step.decode_step,
                                     *decode_inputs(weights, kv.k, kv.v, prev_tokens, b, self.put),
                                     cfg=self.cfg, impl=self.impl)
        return tok, logp, KVStore(k, v)

    def _no_prev(self):
        if self._zeros is None:
            self._zeros = self.put(np.zeros(self.max_batch, np.int32))
        return self._zeros

    def warm(self, weights, kv: KVStore, *, decode=(), prefill=(), truncate=(False,)) -> KVStore:
        """Compile (and run once, on padding rows that write only the scratch page) each decode bucket
        (rows, page-table width), for each `truncate` variant of the sampler (whether top-k/top-p is
        compiled in), and each prefill bucket (rows, chunk width, page-table width). The compilations run
        `compile_workers()` at a time (`compile_all`), the runs after them."""
        self.compile_all(weights, kv, decode=decode, prefill=prefill, truncate=truncate)
        for rows, pages in decode:
            for tr in truncate:
                _, _, kv = self.decode(weights, kv, padding_batch(rows, pages, tr))
        for rows, width, pages in prefill:
            b = PrefillBatch([], np.zeros((rows, width), np.int32), np.zeros(rows, np.int32),
                             np.zeros(rows, np.int32), np.zeros((rows, pages), np.int32))
            kv = self.prefill(weights, kv, b)
        return jax.block_until_ready(kv)

    def compile_all(self, weights, kv: KVStore, *, decode=(), prefill=(), truncate=(False,), workers=None) -> int:
        """Compile every listed step's executable from abstract inputs (nothing runs), `workers` threads at a
        time (default `compile_workers()`): XLA compiles one executable on one core with the GIL released, so
        a cold start's warm-up takes about 1/cores of the time. Returns how many were new. The executables are
        the ones `decode`/`prefill` then use (the same cache key: shapes, dtypes, shardings)."""
        rep = self.replicated
        put = lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=rep)  # noqa: E731
        jobs = [("decode", model_step.decode_step,
                 decode_inputs(weights, kv.k, kv.v, self._no_prev(), padding_batch(rows, pages, tr), put))
                for rows, pages in decode for tr in truncate]
        zeros = lambda *shape: put(np.zeros(shape, np.int32))  # noqa: E731
        jobs += [("prefill", model_step.prefill_step,
                  (weights, kv.k, kv.v, zeros(rows, width), zeros(rows), zeros(rows), zeros(rows, pages)))
                 for rows, width, pages in prefill]
        jobs = [j for j in jobs if not self.cache.has(j[0], j[1], *j[2], cfg=self.cfg, impl=self.impl)]
        one = lambda j: self.cache.compile(j[0], j[1], *j[2], cfg=self.cfg, impl=self.impl)  # noqa: E731
        threads = min(len(jobs), workers or compile_workers())
        if threads == 1:              # in this thread (a background compile stays on its own thread)
            for j in jobs:
                one(j)
        elif jobs:
            with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                list(pool.map(one, jobs))
        return len(jobs)


def compile_workers() -> int:
    """Threads that compile at once in a warm-up: the cores this process may use (JAXRL_COMPILE_WORKERS
    overrides; 1 compiles one after another)."""
    env = os.environ.get("JAXRL_COMPILE_WORKERS")
    if env:
        return max(1, int(env))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:                              # not on Linux
        return max(1, os.cpu_count() or 1)

