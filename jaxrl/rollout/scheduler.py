"""The host scheduler of one rollout instance: admission, pages, prefix sharing, preemption, retirement.

Pure Python (numpy only builds the step inputs; no JAX), so its state is plain values: every live
sequence can leave as a `SequenceState` and continue on another instance or layout, the whole scheduler
can be snapshotted and restored, and a simulator can drive it without devices. The device work it plans
(prefill chunks, page copies, decode steps) is run by the instance's executor.

Per step (see `Instance.launch`):
  1. `admit`: waiting sequences (FCFS, or LPT by priority) while their pages fit and the batch has room; a GRPO group of n
     fresh samples is admitted together and prefilled once (prefix sharing);
  2. `prefill_batches`: chunks of admitted prompts (positions [computed, len-1)), one batched call each;
     `fork` then links siblings to the leader's full prompt pages and copies the page holding the last
     prompt position (copy-on-write);
  3. `ensure_pages`: every running sequence owns the page its next position lands in; when the pool is
     empty the most recently admitted sequence is preempted (pages freed, recomputed later; counted);
  4. `decode_batch`: the running set, padded to a batch bucket; `take_tokens` appends what the device
     sampled and retires finished sequences at once.

Every step's shape comes from the instance's bounded `ShapeBuckets` (shapes.py), so a run compiles a
fixed set of executables, all of them at start (`Executor.warm_all`).

A sequence may hold KV pages while waiting (attached with migrated KV when the running batch was full):
admission then only allocates what it still lacks, and prefill starts at its `computed` position.

Multi-turn: a sequence whose sampled tokens end with one of its `turn_stops` leaves the running set but keeps
its pages (`paused`: no decode slot). `resume` appends an observation (tool output, a user message) to its
tokens and queues it at the front: admission then allocates only the pages the new tokens need and prefill
covers only them (positions [computed, len-1)), so the conversation so far is never recomputed. The
observation's spans are kept (`appended`): they are context, not samples. A paused sequence's KV is
preemptible like any other (dropped newest first before a running sequence is preempted; it then recomputes).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque

import numpy as np

from .pages import PagePool
from .sequence import DecodeBatch, PrefillBatch, Sequence, SequenceState
from .shapes import ShapeBuckets

__all__ = ["DecodeBatch", "PrefillBatch", "Scheduler", "SchedulerSnapshot", "Sequence", "SequenceState"]


@dataclasses.dataclass(frozen=True)
class SchedulerSnapshot:
    """Everything a scheduler holds, as values (take it with nothing in flight)."""

    free_pages: tuple[int, ...]
    page_refs: tuple[int, ...]
    waiting: tuple[SequenceState, ...]
    running: tuple[SequenceState, ...]
    preemptions: int
    generated: int
    paused: tuple[SequenceState, ...] = ()


ORDERS = ("fcfs", "lpt")


class Scheduler:
    def __init__(self, num_pages: int, page_size: int, *, max_batch: int = 64, prefill_chunk: int = 256,
                 prefill_tokens: int = 8192, prefix_sharing: bool = True, shapes: ShapeBuckets | None = None,
                 order: str = "fcfs"):
        """`shapes`: the step shapes (default: buckets for sequences as long as the whole pool holds).
        `order`: admission order of waiting sequences, "fcfs" (arrival) or "lpt" (StreamRL §5.3: largest
        `priority` — the predicted length — first, arrival order among equals; preempted sequences still
        go back to the front)."""
        if order not in ORDERS:
            raise ValueError(f"order={order!r}; valid choices: {', '.join(ORDERS)}")
        self.pool = PagePool(num_pages, page_size)
        self.max_batch, self.prefill_chunk, self.prefix_sharing = max_batch, prefill_chunk, prefix_sharing
        self.order = order
        self.batch_cap = max_batch        # running sequences at most (<= max_batch: the compiled shapes)
        self.prefill_tokens = max(prefill_tokens, prefill_chunk)
        self.shapes = shapes or ShapeBuckets.build(max_batch=max_batch, max_seq_len=self.pool.capacity * page_size,
                                                   page_size=page_size, prefill_chunk=prefill_chunk,
                                                   prefill_tokens=self.prefill_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.paused: list[Sequence] = []      # between turns, holding their pages (multi-turn)
        self.preemptions = self.generated = 0
        self.prefilled = 0                    # prompt/observation positions prefilled (K/V computed by prefill)

    # ------------------------------------------------------------------ requests
    def check_fits(self, seqs: list[Sequence]):
        need = self.pool.pages_for(max(len(s.prompt) for s in seqs) + seqs[0].params.max_new_tokens)
        if need > self.pool.capacity:
            raise ValueError(f"request {seqs[0].rid}: prompt {len(seqs[0].prompt)} + max_new_tokens "
                             f"{seqs[0].params.max_new_tokens} needs {need} pages; the pool has {self.pool.capacity}")

    def add(self, seqs: list[Sequence]):
        self.check_fits(seqs)
        if self.order == "fcfs":
            self.waiting.extend(seqs)
            return
        for s in seqs:            # LPT: before the first waiting sequence of a lower priority (stable)
            at = next((i for i, w in enumerate(self.waiting) if w.priority < s.priority), len(self.waiting))
            self.waiting.insert(at, s)

    def set_batch_cap(self, cap: int):
        """Run at most `cap` sequences at once (1..max_batch; no new shapes). Running sequences beyond a
        lowered cap finish; only admission obeys it."""
        if not 1 <= cap <= self.max_batch:
            raise ValueError(f"batch cap {cap} must be in 1..{self.max_batch} (the instance's max_batch)")
        self.batch_cap = int(cap)

    def find(self, rid: int) -> Sequence | None:
        return next((s for s in itertools.chain(self.waiting, self.running, self.paused) if s.rid == rid), None)

    def remove(self, s: Sequence, *, free: bool = True):
        """Take `s` out of its queue; with `free` its pages return to the pool."""
        (self.waiting if s in self.waiting else self.paused if s.paused else self.running).remove(s)
        s.paused = False
        if free:
            self.pool.free(s.pages)
            s.pages = []
        s.done = True

    @property
    def load(self) -> int:
        return sum(len(s) for s in itertools.chain(self.waiting, self.running, self.paused))

    @property
    def live(self) -> list[Sequence]:
        return list(self.running) + list(self.waiting) + list(self.paused)

    def resume(self, s: Sequence, tokens) -> None:
        """Append `tokens` (an observation) to paused `s` and queue it to continue, at the front (a trajectory
        under way goes before new prompts). Its KV is kept: only the new positions are prefilled."""
        if not s.paused:
            raise RuntimeError(f"request {s.rid} is not paused at a turn stop")
        if s.pending:
            raise RuntimeError(f"request {s.rid} has a token in flight; drain before resuming")
        tokens = [int(t) for t in tokens]
        if len(s.out) + len(tokens) >= s.params.max_new_tokens:
            raise ValueError(f"request {s.rid}: {len(s.out)} tokens after the prompt + {len(tokens)} appended "
                             f"leaves no room to generate (max_new_tokens={s.params.max_new_tokens})")
        if tokens:
            s.appended.append((len(s.out), len(s.out) + len(tokens)))
            s.out += tokens
            s.logprobs += [0.0] * len(tokens)
        self.paused.remove(s)
        s.paused = s.done = False
        self.waiting.appendleft(s)

    # ------------------------------------------------------------------ one step's plan
    def admit(self) -> list[list[Sequence]]:
        """Admit waiting sequences in queue order (`order`); each entry is a group sharing one prefill (its leader first)."""
        admitted = []
        while self.waiting:
            head = self.waiting[0]
            group = [s for s in self.waiting if head.group is not None and s.group == head.group
                     and s.computed == 0 and not s.out and not s.pages] if self.prefix_sharing else []
            # The head leads its group only when it is fresh too: one with output or pages (re-queued by a
            # recompute relayout or a preemption) is admitted alone, and its fresh siblings share a prefill later.
            group = group if group and group[0] is head else [head]
            per_seq = self.pool.pages_for(len(head))
            shared = (len(head.prompt) - 1) // self.pool.page_size
            # A group that could never run at once (more samples than max_batch, or more pages than the
            # whole pool) is admitted in parts; each part shares its own prefill. Otherwise it waits whole.
            fits_pool = 1 + max(0, (self.pool.capacity - per_seq) // max(per_seq - shared, 1))
            group = group[:min(self.batch_cap, fits_pool)]
            if len(self.running) + sum(map(len, admitted)) + len(group) > self.batch_cap:
                break
            shared = shared if len(group) > 1 else 0
            need = per_seq - len(head.pages) + (len(group) - 1) * (per_seq - shared)
            if need > self.pool.available:
                if self.running or admitted or not self._evict_waiting_kv(need):
                    break
                continue
            for s in group:
                self.waiting.remove(s)
            head.pages += self.pool.alloc(per_seq - len(head.pages))
            for s in group[1:]:                # own pages now; the shared prefix is linked in `fork`
                s.pages = self.pool.alloc(per_seq - shared)
            admitted.append(group)
        return admitted

    def _evict_waiting_kv(self, need: int) -> bool:
        """Nothing runs and the head cannot fit: drop KV held by paused, then waiting sequences (newest first)."""
        while self.pool.available < need and self._evict_paused():
            pass
        for s in reversed(self.waiting):
            if self.pool.available >= need:
                break
            if s.pages and s is not self.waiting[0]:
                self.pool.free(s.pages)
                s.pages, s.computed = [], 0
        return self.pool.available >= need

    def prefill_batches(self, seqs: list[Sequence]):
        """Yield the prefill calls that bring every sequence to `computed == len - 1` (advancing as it goes)."""
        sh, ps = self.shapes, self.pool.page_size
        while True:
            todo = [s for s in seqs if s.computed < len(s) - 1]
            if not todo:
                return
            width = sh.prefill_width(max(len(s) - 1 - s.computed for s in todo))
            todo = todo[:sh.prefill_rows_cap(width)]
            n = [min(width, len(s) - 1 - s.computed) for s in todo]
            need = [-(-(s.computed + k) // ps) for s, k in zip(todo, n)]   # pages holding the chunk's K/V
            rows, _, mp = sh.prefill(len(todo), width, max(need))
            b = PrefillBatch(todo, np.zeros((rows, width), np.int32), np.zeros(rows, np.int32),
                             np.zeros(rows, np.int32), np.zeros((rows, mp), np.int32))
            for i, (s, k, p) in enumerate(zip(todo, n, need)):
                b.tokens[i, :k] = s.tokens[s.computed:s.computed + k]
                b.start[i], b.n_valid[i] = s.computed, k
                b.table[i, :p] = s.pages[:p]
                s.computed += k
            self.prefilled += sum(n)
            yield b

    def fork(self, group: list[Sequence]) -> list[tuple[int, int]]:
        """Siblings share the leader's full prompt pages; returns the (src, dst) page copies to run (the
        page with the last prompt position, copied into each sibling's first own page)."""
        head = group[0]
        last = (len(head.prompt) - 1) // self.pool.page_size
        copies = []
        for s in group[1:]:
            own = s.pages
            s.pages = self.pool.share(head.pages[:last]) + own
            copies.append((head.pages[last], own[0]))
            s.computed = head.computed
        return copies

    def start(self, groups: list[list[Sequence]]):
        for g in groups:
            self.running.extend(g)

    def _evict_paused(self) -> bool:
        """Drop the KV of the most recently paused sequence still holding some (it recomputes on resume)."""
        victim = next((s for s in reversed(self.paused) if s.pages), None)
        if victim is None:
            return False
        self.pool.free(victim.pages)
        victim.pages, victim.computed, victim.group = [], 0, None
        victim.preemptions += 1
        self.preemptions += 1
        return True

    def _preempt(self) -> Sequence | None:
        """Free pages: a paused sequence's KV first (None returned), else the most recently admitted running one."""
        if self._evict_paused():
            return None
        victim = self.running.pop()            # most recently admitted
        self.pool.free(victim.pages)
        victim.pages, victim.computed, victim.group = [], 0, None
        victim.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(victim)
        return victim

    def drop_kv(self) -> int:
        """Drop every live sequence's K/V (a weight update with kv="recompute"): running sequences go back to
        the front of the queue in their order and each re-prefills prompt + tokens, so its K/V is the new
        weights'; paused ones recompute on resume. None may have a token in flight. Returns the positions
        dropped (what the re-prefills will compute again)."""
        if any(s.pending for s in self.running):
            raise RuntimeError("drop_kv with a step in flight; pause (drain) first")
        dropped = 0
        for s in itertools.chain(self.running, self.waiting, self.paused):
            if s.pages:
                self.pool.free(s.pages)
                dropped += s.computed
                s.pages, s.computed, s.group = [], 0, None
        self.waiting.extendleft(reversed(self.running))
        self.running = []
        return dropped

    @staticmethod
    def next_len(s: Sequence) -> int:
        """Tokens of `s` once its in-flight token lands (the next step feeds position this - 1)."""
        return len(s) + s.pending

    @staticmethod
    def decodes_next(s: Sequence) -> bool:
        return len(s.out) + s.pending < s.params.max_new_tokens

    def shortfall(self) -> int:
        """Pages the running set needs for its next step beyond those free now."""
        short = sum(max(0, self.pool.pages_for(self.next_len(s)) - len(s.pages))
                    for s in self.running if self.decodes_next(s))
        return max(0, short - self.pool.available)

    def ensure_pages(self):
        """Give every running sequence the page its next position lands in, preempting when out of pages.
        The caller drains in-flight steps first when `shortfall()` > 0 (victims must have nothing unread)."""
        i = 0
        while i < len(self.running):
            s = self.running[i]
            while self.decodes_next(s) and self.pool.pages_for(self.next_len(s)) > len(s.pages):
                if self.pool.available == 0:
                    if self._preempt() is s:
                        break
                    continue
                s.pages += self.pool.alloc(1)
            else:
                i += 1

    def decode_batch(self, prev: list[Sequence] | None = None) -> DecodeBatch | None:
        """The next decode step's inputs (None when nothing decodes). `prev` is the batch of the step still
        in flight: a sequence with a pending token takes it from that step's output row on the device."""
        seqs = [s for s in self.running if self.decodes_next(s)]
        if not seqs:
            return None
        # Both from the bounded buckets; the page-table width matters because the XLA decode path gathers
        # (and attends over) every page slot of every row, each layer, each step.
        rows, mp = self.shapes.decode(len(seqs), max(len(s.pages) for s in seqs))
        b = DecodeBatch(seqs, np.zeros(rows, np.int32), np.zeros(rows, np.int32), np.full(rows, -1, np.int32),
                        np.zeros((rows, mp), np.int32), [])
        prev_rows = {id(s): i for i, s in enumerate(prev or [])}
        for i, s in enumerate(seqs):
            b.positions[i] = self.next_len(s) - 1
            if s.pending:
                b.src[i] = prev_rows[id(s)]     # the token is the previous step's output, still on the device
            else:
                b.tokens[i] = s.out[-1] if s.out else s.prompt[-1]     # (s.tokens would copy the sequence)
            b.table[i, :len(s.pages)] = s.pages
            b.sampling.append((s.params, s.seed, len(s.out) + s.pending))
        for s in seqs:
            s.pending += 1
        return b

    def take_tokens(self, seqs: list[Sequence], tok: np.ndarray, logp: np.ndarray) -> list[tuple[Sequence, str]]:
        """Append a step's sampled tokens; returns the sequences that finished with their reason (their
        pages are still held: `retire` frees them once the caller has read what it needs)."""
        done = []
        for i, s in enumerate(seqs):
            s.pending -= 1
            if s.done:                    # aborted, or stopped at an earlier step: discard
                continue
            s.computed = len(s)           # the fed token's K/V is now cached
            s.out.append(int(tok[i]))
            s.logprobs.append(float(logp[i]))
            self.generated += 1
            if s.out[-1] in s.params.stop_token_ids:
                done.append((s, "stop"))
            elif len(s.out) >= s.params.max_new_tokens:
                done.append((s, "length"))
            elif s.params.multi_turn and s.params.ends_turn(s.out, s.turn_start):
                done.append((s, "turn"))
        for s, reason in done:
            self.running.remove(s)
            s.done = True                 # (a token of it still in flight is discarded)
            if reason == "turn":          # keeps its pages until `resume` (or `remove`)
                s.paused = True
                self.paused.append(s)
        return done

    def retire(self, s: Sequence):
        self.pool.free(s.pages)
        s.pages = []

    # ------------------------------------------------------------------ movable state
    def detach(self, rids, *, keep_kv: bool = True, instance: int | None = None) -> list[SequenceState]:
        """Live sequences leave (none may have a token in flight). With `keep_kv` their pages stay held
        (reference counts kept, shared prompt pages included) until the caller `release`s them after
        moving the KV; otherwise they are freed at once and the states carry no KV."""
        out = []
        for rid in rids:
            s = self.find(rid)
            if s is None:
                raise KeyError(f"request {rid} is not live on this instance")
            if s.pending:
                raise RuntimeError(f"request {rid} has a token in flight; pause (drain) before detaching")
            if not keep_kv:
                self.pool.free(s.pages)
                s.pages, s.computed = [], 0
            st = s.state(instance)
            self.remove(s, free=False)
            out.append(st)
        return out

    def release(self, pages) -> None:
        """Drop the references detached states held on this pool's pages."""
        self.pool.free(list(pages))

    def attach(self, states: list[SequenceState], page_map: dict[int, int] | None = None) -> list[Sequence]:
        """Sequences join: with `page_map` (old page id -> page id in this pool, pages already allocated here
        and holding the migrated KV, shared pages once) they keep their KV and run at once while the batch
        has room (then wait, holding it); without, they wait and recompute (prompt + generated tokens)."""
        seqs = []
        for st in states:
            pages = [page_map[p] for p in st.pages] if page_map is not None and st.pages else None
            s = Sequence.from_state(st, pages)
            if s.paused:
                self.paused.append(s)
            elif pages and len(self.running) < self.batch_cap:
                self.running.append(s)
            else:
                self.waiting.append(s)
            seqs.append(s)
        return seqs

    def snapshot(self) -> SchedulerSnapshot:
        if any(s.pending for s in self.running):
            raise RuntimeError("snapshot with a step in flight; pause (drain) first")
        return SchedulerSnapshot(tuple(self.pool._free), tuple(self.pool._refs), tuple(s.state() for s in self.waiting),
                                 tuple(s.state() for s in self.running), self.preemptions, self.generated,
                                 tuple(s.state() for s in self.paused))

    def restore(self, snap: SchedulerSnapshot):
        if len(snap.page_refs) != self.pool.num_pages:
            raise ValueError(f"snapshot of a {len(snap.page_refs)}-page pool; this pool has {self.pool.num_pages}")
        self.pool._free, self.pool._refs = list(snap.free_pages), list(snap.page_refs)
        self.waiting = deque(Sequence.from_state(st, list(st.pages) or None) for st in snap.waiting)
        self.running = [Sequence.from_state(st, list(st.pages) or None) for st in snap.running]
        self.paused = [Sequence.from_state(st, list(st.pages) or None) for st in snap.paused]
        self.preemptions, self.generated = snap.preemptions, snap.generated
