"""One rollout instance: a TP group on its own sub-mesh with its own paged KV pool and scheduler.

Continuous batching, per `launch()`:
  1. admit waiting sequences (FCFS) while their pages fit and the batch has room; a GRPO group of n
     samples is admitted together and prefilled once (prefix sharing);
  2. prefill admitted sequences together (one group leader per prompt), in chunks of `prefill_chunk`
     tokens per row and at most `prefill_tokens` tokens per call (positions [0, len-1));
     siblings then share the prompt's full pages and copy the page holding the last prompt position;
  3. make sure every running sequence owns the page its next position lands in; when the pool is
     empty, preempt the most recently admitted sequence (pages freed, recomputed later; counted);
  4. dispatch one decode step for the running set, padded to a power-of-two batch bucket.
`collect()` reads the sampled tokens back, appends them and retires finished sequences at once.
`launch` never blocks on device results, so a service dispatches every instance before collecting.

Overlap (default): step n+1 is dispatched before step n's tokens are read. Its input tokens are step
n's device outputs (`model_step.feed_tokens`), its pages are reserved one position ahead, and the host
reads step n while the device runs n+1, so the host's scheduling time hides behind device time. A
sequence that stops at step n has computed one extra token in n+1; it is discarded (its K/V went to the
sequence's own page, freed afterwards; the device orders the later reuse). Sequences whose in-flight
token ends them by length are left out of n+1. Preemption drains the in-flight step first, so victims
never have unread tokens. `overlap=False` reads every step before the next dispatch.

Simplification (stated): prefill runs to completion inside `launch` before the decode dispatch
rather than being mixed into decode batches chunk by chunk.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from models import ModelConfig

from . import model_step
from .pages import PagePool
from .sampling import SamplingBatch, SamplingParams


@dataclasses.dataclass
class Completion:
    request_id: int
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str                    # "stop" | "length" | "abort"
    instance: int
    preemptions: int = 0
    kv: tuple[np.ndarray, np.ndarray] | None = None  # K, V [layers, len(prompt)+len(tokens)-1, K, D]


@dataclasses.dataclass(eq=False)
class Sequence:
    rid: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    group: int | None = None              # shared-prefix group id (None: standalone)
    out: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0                     # positions whose K/V are in the cache
    preemptions: int = 0
    pending: int = 0                      # tokens dispatched but not yet read back (0 or 1)
    done: bool = False                    # retired or aborted: unread tokens are discarded

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out

    def __len__(self):
        return len(self.prompt) + len(self.out)


def fine_bucket(n: int) -> int:
    """Round up to a multiple of 2^(bits(n)-3): at most 25% padding and 4 shapes (compiles) per octave."""
    step = 1 << max(0, n.bit_length() - 3)
    return -(-max(n, 1) // step) * step


def bucket(n: int, cap: int | None = None) -> int:
    b = 1 << max(0, (n - 1).bit_length())
    return b if cap is None else min(b, max(cap, n))


class Instance:
    def __init__(self, index: int, cfg: ModelConfig, mesh, weights, *, num_pages: int, page_size: int = 16,
                 max_batch: int = 64, prefill_chunk: int = 256, prefill_tokens: int = 8192, kv_dtype=None,
                 prefix_sharing: bool = True, attention_impl: str = "xla", overlap: bool = True):
        self.index, self.cfg, self.mesh, self.weights = index, cfg, mesh, weights
        self.pool = PagePool(num_pages, page_size)
        self.max_batch, self.prefill_chunk, self.prefix_sharing = max_batch, prefill_chunk, prefix_sharing
        self.prefill_tokens = max(prefill_tokens, prefill_chunk)
        self.impl, self.overlap = attention_impl, overlap
        tp = mesh.shape["tp"]
        kv_axis = "tp" if cfg.num_kv_heads % tp == 0 else None   # replicated when tp > kv heads
        self.kv_sharding = NamedSharding(mesh, P(None, None, kv_axis, None, None))
        self.replicated = NamedSharding(mesh, P())
        dtype = kv_dtype or jax.tree.leaves(weights)[0].dtype
        shape = (cfg.num_layers, num_pages, cfg.num_kv_heads, page_size, cfg.head_dim)
        self.k_pages = jax.device_put(jnp.zeros(shape, dtype), self.kv_sharding)
        self.v_pages = jax.device_put(jnp.zeros(shape, dtype), self.kv_sharding)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions, self.generated, self.busy_s = 0, 0, 0.0
        self._inflight: deque = deque()   # dispatched decode steps, oldest first (at most 2)
        self._dispatched = False           # whether the latest launch dispatched a step
        self._ready: list[Completion] = []  # completions found while draining inside launch
        self.overlapped = 0                 # steps dispatched while the previous one was still unread

    # ------------------------------------------------------------------ requests
    def add(self, seqs: list[Sequence]):
        need = self.pool.pages_for(max(len(s) for s in seqs) + seqs[0].params.max_new_tokens)
        if need > self.pool.capacity:
            raise ValueError(f"request {seqs[0].rid}: prompt {len(seqs[0].prompt)} + max_new_tokens "
                             f"{seqs[0].params.max_new_tokens} needs {need} pages; the pool has {self.pool.capacity}")
        self.waiting.extend(seqs)

    def abort(self, rid: int) -> Sequence | None:
        for q in (self.waiting, self.running):
            for s in q:
                if s.rid == rid:
                    q.remove(s)
                    self.pool.free(s.pages)
                    s.pages, s.done = [], True
                    return s
        return None

    @property
    def load(self) -> int:
        return sum(len(s) for s in itertools.chain(self.waiting, self.running))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._inflight or self._ready)

    # ------------------------------------------------------------------ scheduling
    def _admit(self) -> list[list[Sequence]]:
        admitted = []
        while self.waiting:
            head = self.waiting[0]
            group = [s for s in self.waiting if head.group is not None and s.group == head.group
                     and s.computed == 0 and not s.out] if self.prefix_sharing else []
            group = group or [head]
            if len(self.running) + sum(map(len, admitted)) + len(group) > self.max_batch:
                break
            per_seq = self.pool.pages_for(len(head))
            shared = (len(head.prompt) - 1) // self.pool.page_size if len(group) > 1 else 0
            if per_seq + (len(group) - 1) * (per_seq - shared) > self.pool.available:
                break
            for s in group:
                self.waiting.remove(s)
            head.pages = self.pool.alloc(per_seq)
            for s in group[1:]:                # own pages now; the shared prefix is linked in _fork
                s.pages = self.pool.alloc(per_seq - shared)
            admitted.append(group)
        return admitted

    def _prefill(self, seqs: list[Sequence]):
        C = self.prefill_chunk
        while True:
            todo = [s for s in seqs if s.computed < len(s) - 1]
            if not todo:
                return
            width = bucket(min(C, max(len(s) - 1 - s.computed for s in todo)))
            todo = todo[:max(1, self.prefill_tokens // width)]
            rows = bucket(len(todo))
            mp = bucket(max(len(s.pages) for s in todo))
            tokens = np.zeros((rows, width), np.int32)
            start, n_valid = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
            table = np.zeros((rows, mp), np.int32)
            for i, s in enumerate(todo):
                n = min(width, len(s) - 1 - s.computed)
                tokens[i, :n] = s.tokens[s.computed:s.computed + n]
                start[i], n_valid[i] = s.computed, n
                table[i, :len(s.pages)] = s.pages
                s.computed += n
            put = lambda x: jax.device_put(x, self.replicated)
            self.k_pages, self.v_pages = model_step.prefill_step(
                self.weights, self.cfg, self.k_pages, self.v_pages, put(tokens), put(start), put(n_valid), put(table),
                impl=self.impl)

    def _fork(self, group: list[Sequence]):
        """Siblings share the leader's full prompt pages and copy the page with the last prompt position."""
        head = group[0]
        last = (len(head.prompt) - 1) // self.pool.page_size
        for s in group[1:]:
            own = s.pages
            s.pages = self.pool.share(head.pages[:last]) + own
            self.k_pages, self.v_pages = model_step.copy_page(self.k_pages, self.v_pages, head.pages[last], own[0])
            s.computed = head.computed

    def _preempt(self) -> Sequence:
        victim = self.running.pop()            # most recently admitted
        self.pool.free(victim.pages)
        victim.pages, victim.computed, victim.group = [], 0, None
        victim.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(victim)
        return victim

    def _next_len(self, s: Sequence) -> int:
        """Tokens of `s` once its in-flight token lands (the next step feeds position this - 1)."""
        return len(s) + s.pending

    def _decodes_next(self, s: Sequence) -> bool:
        return len(s.out) + s.pending < s.params.max_new_tokens

    def _ensure_pages(self):
        short = sum(max(0, self.pool.pages_for(self._next_len(s)) - len(s.pages))
                    for s in self.running if self._decodes_next(s))
        if short > self.pool.available and self._inflight:
            self._drain()                  # preemption only ever sees sequences with nothing in flight
        i = 0
        while i < len(self.running):
            s = self.running[i]
            while self._decodes_next(s) and self.pool.pages_for(self._next_len(s)) > len(s.pages):
                if self.pool.available == 0:
                    if self._preempt() is s:
                        break
                    continue
                s.pages += self.pool.alloc(1)
            else:
                i += 1

    def _drain(self):
        while self._inflight:
            self._ready += self._read(self._inflight.popleft())

    def launch(self) -> bool:
        """Admit, prefill, dispatch one decode step (never waits for the device). Returns whether a
        step was dispatched."""
        t0 = time.perf_counter()
        groups = self._admit()
        self._prefill([g[0] for g in groups])      # one batched prefill for every admitted prompt
        for group in groups:
            if len(group) > 1:
                self._fork(group)
            self.running.extend(group)
        self._ensure_pages()
        batch = [s for s in self.running if self._decodes_next(s)]
        self._dispatched = bool(batch)
        if not batch:
            return False
        # Batch rows: power-of-two buckets. Page-table width: finer buckets, because the XLA decode path
        # gathers (and attends over) every page slot of every row, each layer, each step.
        rows, mp = bucket(len(batch)), fine_bucket(max(len(s.pages) for s in batch))
        tokens, pos, src = np.zeros(rows, np.int32), np.zeros(rows, np.int32), np.full(rows, -1, np.int32)
        table = np.zeros((rows, mp), np.int32)
        prev_rows = {id(s): i for i, s in enumerate(self._inflight[-1][0])} if self._inflight else {}
        for i, s in enumerate(batch):
            pos[i] = self._next_len(s) - 1
            if s.pending:
                src[i] = prev_rows[id(s)]   # the token is step n's output, still on the device
            else:
                tokens[i] = s.tokens[-1]
            table[i, :len(s.pages)] = s.pages
        sb = SamplingBatch.build([(s.params, s.seed, len(s.out) + s.pending) for s in batch], rows)
        put = lambda x: jax.device_put(x, self.replicated)
        tok_in = put(tokens)
        if (src >= 0).any():
            tok_in = model_step.feed_tokens(self._inflight[-1][1], put(src), tok_in)
        tok, logp, self.k_pages, self.v_pages = model_step.decode_step(
            self.weights, self.cfg, self.k_pages, self.v_pages, tok_in, put(pos), put(table),
            jax.tree.map(put, sb), impl=self.impl)
        for s in batch:
            s.pending += 1
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
        done = []
        for i, s in enumerate(batch):
            s.pending -= 1
            if s.done:                    # aborted, or stopped at an earlier step: discard
                continue
            s.computed = len(s)           # the fed token's K/V is now cached
            s.out.append(int(tok[i]))
            s.logprobs.append(float(logp[i]))
            self.generated += 1
            if s.out[-1] in s.params.stop_token_ids:
                done.append(self._retire(s, "stop"))
            elif len(s.out) >= s.params.max_new_tokens:
                done.append(self._retire(s, "length"))
        return done

    def _retire(self, s: Sequence, reason: str) -> Completion:
        self.running.remove(s)
        s.done = True
        kv = None
        if s.params.return_kv:
            n = len(s) - 1
            k, v = model_step.export_kv(self.k_pages, self.v_pages, jnp.asarray(s.pages, jnp.int32))
            kv = (np.asarray(k)[:, :n], np.asarray(v)[:, :n])
        self.pool.free(s.pages)
        s.pages = []
        return Completion(s.rid, s.prompt, s.out, s.logprobs, reason, self.index, s.preemptions, kv)

    def stats(self) -> dict:
        return {"instance": self.index, "tp": self.mesh.shape["tp"], "active_batch": len(self.running),
                "waiting": len(self.waiting), "context_tokens": sum(len(s) for s in self.running),
                "pages_used": self.pool.used, "pages_total": self.pool.capacity, "preemptions": self.preemptions,
                "generated_tokens": self.generated, "overlapped_steps": self.overlapped,
                "tokens_per_s": self.generated / self.busy_s if self.busy_s else 0.0}
