"""The executor of one rollout instance: runs the compiled prefill/decode steps from an explicit cache.

`ExecutableCache` holds ahead-of-time compiled executables (`jit(...).lower(...).compile()`) keyed by
(step, static arguments, the abstract signature of every input: pytree structure, shapes, dtypes and
shardings). The shardings carry the instance's devices and layout, so the key is (layout, batch bucket,
shapes) as ARCHITECTURE.md asks: an instance rebuilt on the same devices and layout (PAT switching back,
a service rebuilt after `relayout`) reuses its executables, and `compiles` / `compile_s` count exactly the
compilations the rollout caused. One process-wide cache (`CACHE`) serves every instance and service.

`Executor.warm(weights, kv, decode=[(rows, pages)], prefill=[(rows, width, pages)])` compiles ahead and
runs each step once on dummy inputs whose every row is padding, so it writes only the scratch page 0.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from models import ModelConfig

from . import model_step
from .kv_store import KVStore
from .params import SamplingParams
from .sampling import SamplingBatch
from .scheduler import DecodeBatch, PrefillBatch


def _signature(args) -> tuple:
    leaves, treedef = jax.tree.flatten(args)
    sig = []
    for x in leaves:
        if isinstance(x, jax.Array):
            sh = x.sharding
            if isinstance(sh, NamedSharding):      # P(None, 'tp') and P(None, 'tp', None) are one sharding
                spec = tuple(sh.spec) + (None,) * (x.ndim - len(sh.spec))
                sh = (sh.mesh, spec, sh.memory_kind)
            sig.append((x.shape, x.dtype, sh))
        else:
            x = np.asarray(x)
            sig.append((x.shape, x.dtype))
    return treedef, tuple(sig)


@dataclasses.dataclass
class ExecutableCache:
    """AOT-compiled executables by (name, static args, input signature); counts compilations.

    Least-recently-used entries beyond `maxsize` are dropped (and recompiled, counted, if needed again):
    every XLA:CPU executable holds a few memory mappings per device, and a process has a limited number
    (vm.max_map_count), so an unbounded cache eventually makes LLVM abort a later compilation."""

    maxsize: int = 512
    compiles: int = 0
    compile_s: float = 0.0
    calls: int = 0
    _table: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)

    def __call__(self, name: str, fn, *args, **static):
        key = (name, tuple(sorted(static.items())), _signature(args))
        exe = self._table.get(key)
        if exe is None:
            t = time.perf_counter()
            exe = fn.lower(*args, **static).compile()
            self.compile_s += time.perf_counter() - t
            self.compiles += 1
            self._table[key] = exe
            while len(self._table) > self.maxsize:
                self._table.popitem(last=False)
        else:
            self._table.move_to_end(key)
        self.calls += 1
        return exe(*args)

    def clear(self):
        """Drop every executable (the counters stay)."""
        self._table.clear()

    def __len__(self):
        return len(self._table)


CACHE = ExecutableCache()


class Executor:
    """Runs one instance's device steps (prefill, decode, token feed) on its mesh through `CACHE`."""

    def __init__(self, cfg: ModelConfig, mesh, *, attention_impl: str = "xla", cache: ExecutableCache = CACHE):
        self.cfg, self.mesh, self.impl, self.cache = cfg, mesh, attention_impl, cache
        self.replicated = NamedSharding(mesh, PartitionSpec())

    def put(self, x):
        return jax.device_put(x, self.replicated)

    def prefill(self, weights, kv: KVStore, b: PrefillBatch) -> KVStore:
        k, v = self.cache("prefill", model_step.prefill_step, weights, kv.k, kv.v, self.put(b.tokens),
                          self.put(b.start), self.put(b.n_valid), self.put(b.table), cfg=self.cfg, impl=self.impl)
        return KVStore(k, v)

    def decode(self, weights, kv: KVStore, b: DecodeBatch, prev_tokens=None):
        """Dispatch one decode step; returns (tokens, logprobs, kv) as device arrays (nothing is read)."""
        rows = len(b.tokens)
        tok_in = self.put(b.tokens)
        if (b.src >= 0).any():
            tok_in = self.cache("feed", model_step.feed_tokens, prev_tokens, self.put(b.src), tok_in)
        sb = jax.tree.map(self.put, SamplingBatch.build(b.sampling, rows))
        tok, logp, k, v = self.cache("decode", model_step.decode_step, weights, kv.k, kv.v, tok_in,
                                     self.put(b.positions), self.put(b.table), sb, cfg=self.cfg, impl=self.impl)
        return tok, logp, KVStore(k, v)

    def warm(self, weights, kv: KVStore, *, decode=(), prefill=(), truncate=(False,)) -> KVStore:
        """Compile (and run once, on padding rows that write only the scratch page) each decode bucket
        (rows, page-table width) and prefill bucket (rows, chunk width, page-table width)."""
        for rows, pages in decode:
            for tr in truncate:
                params = SamplingParams(temperature=1.0, top_k=2) if tr else SamplingParams(temperature=0.0)
                src = np.full(rows, -1, np.int32)
                src[0] = 0                      # also compiles the on-device token feed of overlapped steps
                b = DecodeBatch([], np.zeros(rows, np.int32), np.zeros(rows, np.int32), src,
                                np.zeros((rows, pages), np.int32), [(params, 0, 0)])
                _, _, kv = self.decode(weights, kv, b, prev_tokens=self.put(np.zeros(rows, np.int32)))
        for rows, width, pages in prefill:
            b = PrefillBatch([], np.zeros((rows, width), np.int32), np.zeros(rows, np.int32),
                             np.zeros(rows, np.int32), np.zeros((rows, pages), np.int32))
            kv = self.prefill(weights, kv, b)
        return jax.block_until_ready(kv)
