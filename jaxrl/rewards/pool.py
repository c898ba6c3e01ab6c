"""RewardPool: reward functions in worker processes with hard per-sample timeouts.

    with RewardPool(num_workers=4, timeout_s=5.0) as pool:
        scores, stats = pool.score([("math", response, answer, "math"), ...])   # batch: blocks, never hangs
        # stats == {"timeouts": 0, "crashes": 0, "seconds": 0.31}

        i = pool.submit(("builtin", response, answer, "copy"))                  # streaming (RollPacker)
        for r in pool.poll(timeout=0.1):    # RewardResult(id, score, status, error, seconds, latency_s, info)
            ...
        pool.cancel(i)                      # an aborted response: dropped, or its worker killed if asked


        pool.check(["math", "my_rewards:score"])   # {name: why it does not resolve in a worker}

An item is `(fn, response, answer, task)` where `fn` names a reward function (`registry.resolve`), with
an optional fifth element `extra`: a dict of keyword arguments for this item only (picklable; the row values
the function takes, `registry.reward_item`, and e.g. the code reward's per-test-case `timeouts`), called as
`fn(response, answer, task, **extra)` (its leading positional parameters only, or TRL's batched form:
`jaxrl.rewards.calling.invoke`). A function may
return a float, or a `(score, info)` pair whose `info` dict comes back as `RewardResult.info` (the code
reward's per-case run times, which feed the adaptive timeouts). Every item ends with exactly one status:

* `"ok"`      the function returned a finite float; that is the score.
* `"timeout"` it ran longer than its timeout: its worker is SIGKILLed and replaced, the score is 0.
* `"crash"`   the function raised, returned a non-finite value, or its worker died (`os._exit`, a
              segfault, the OOM killer): the score is 0; a dead worker is replaced.

A failed result carries its cause in `RewardResult.error` ("ZeroDivisionError: division by zero",
"timed out after 5s", "worker died (killed by SIGSEGV)"); an ok result has `error == ""`.

Failures are counted per call (`stats`) and over the pool's life (`total_timeouts`, `total_crashes`,
`total_cancelled`) so the trainer can log them as metrics; a step never waits on a hung verifier.
`RewardResult.seconds` is the time the item ran (dispatch to result; the timeout for a timeout) and
`latency_s` the time since `submit` (queueing included).

`cancel(id)` withdraws a submitted item (its response was aborted): a queued item is dropped; an item
already scored but not yet polled is dropped; a running item is dropped when its result arrives, or,
with `kill_running=True`, its worker is SIGKILLed (taking a sandboxed program down with it) and replaced
— worth it for long code runs, not for a math check that ends in milliseconds. A cancelled item never
appears in `poll()`.

Design:

* Long-lived workers, one pipe each, one item in flight per worker. A per-worker pipe (rather than a
  shared queue) means killing a hung worker cannot corrupt a lock or buffer other workers use, and the
  item it held is known exactly. Workers start with the `forkserver` method by default (`spawn` also
  works), never `fork`: the parent runs JAX's threads, which `fork` would copy in an arbitrary state.
  The fork server preloads this module (and so math-verify/SymPy), so replacing a killed worker costs
  ~0.1 s instead of a fresh interpreter's ~1 s. Each worker warms up (a first math-verify call) and
  reports ready before it is given work, so start-up never counts against an item's timeout.
* One dispatcher thread in the parent hands queued items to idle workers and waits on every worker's
  pipe and process sentinel with `multiprocessing.connection.wait`, with a timeout equal to the nearest
  deadline. A timeout is therefore enforced within milliseconds of its deadline, independent of how
  often the caller polls, and scoring proceeds while the caller is busy (e.g. dispatching decode steps).
* Each worker starts with the parent's `sys.path` as it is at that moment (`multiprocessing` sends it
  with both start methods, `""` made the parent's start directory), so a reward module the parent can
  import — from `PYTHONPATH`, the directory `python -m ...` started in, or a directory added to
  `sys.path` at run time before the pool starts — imports in the workers too. `check(names)` resolves
  names in a fresh process started exactly like a worker, and reports which do not resolve there.
* Workers ignore SIGINT (the parent owns Ctrl-C and shuts them down) and exit when the parent process
  dies, even mid-item, via a watcher thread on the parent's sentinel.
* `num_workers=0` runs functions in the calling thread: no processes, **no timeouts** (a hanging
  function hangs the caller), exceptions still score 0 as crashes. For debugging with pdb/profilers.

Streaming (RollPacker §4.3, "asynchronous reward computation"): `submit` as each sequence finishes,
`poll` collects whatever has been scored, in completion order, so reward time hides under rollout time.
`submit(..., timeout_s=)` takes a per-item timeout, the hook for adaptive timeouts.

Simplified relative to RollPacker: the adaptive timeout policy (`jaxrl.rewards.timeouts`) and per-group
completion live in `jaxrl.rewards.scheduler` on top of this pool; no GPU sharing for judge models; items
are served FIFO, not by predicted cost. Items still queued or in flight at `close()` are dropped without
a result.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import multiprocessing as mp
import threading
import time
from multiprocessing.connection import wait as _mp_wait
from typing import Mapping, NamedTuple, Sequence

import numpy as np

from . import registry
from .pool_worker import RewardItem, _Worker, _call, _check_main, _error_text, _exit_text

logger = logging.getLogger(__name__)

START_METHODS = ("forkserver", "spawn")
STATUSES = ("ok", "timeout", "crash")
_MAX_LOGGED = 10  # failures logged at WARNING per pool; the rest at DEBUG (they are counted anyway)
_MAX_TICK_S = 1.0  # dispatcher wakes at least this often (to notice close())


class _Result(NamedTuple):
    id: int
    score: float
    status: str  # one of STATUSES
    error: str = ""  # the cause of a timeout or crash ("" when ok)


class RewardResult(_Result):
    """`(id, score, status, error)`, plus attributes outside the tuple (so unpacking and equality with
    4-tuples are as before): `seconds` (time it ran: dispatch to result; the timeout for a timeout),
    `latency_s` (submit to result, queueing included) and `info` (the function's own details, when it
    returned `(score, info)`; else None)."""

    def __new__(cls, id: int, score: float, status: str, error: str = "", seconds: float = 0.0,
                latency_s: float = 0.0, info: dict | None = None):
        self = super().__new__(cls, id, score, status, error)
        self.seconds, self.latency_s, self.info = float(seconds), float(latency_s), info
        return self

    def __repr__(self) -> str:
        return (f"RewardResult(id={self.id}, score={self.score}, status={self.status!r}, error={self.error!r}, "
                f"seconds={self.seconds:.3f}, latency_s={self.latency_s:.3f})")


# ---------------------------------------------------------------------------------------- the pool
class RewardPool:
    """Process pool for reward functions with hard per-item timeouts. See the module docstring."""

    def __init__(self, num_workers: int = 2, timeout_s: float = 5.0, *, start_method: str = "forkserver",
                 startup_timeout_s: float = 60.0, max_start_failures: int = 3):
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers} must be >= 0 (0 = in-process, no timeouts)")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        if start_method not in START_METHODS:
            raise ValueError(f"start_method={start_method!r}; valid choices: {', '.join(START_METHODS)} "
                             "(not 'fork': the parent runs JAX threads)")
        self.num_workers, self.timeout_s = num_workers, float(timeout_s)
        self.start_method, self.startup_timeout_s = start_method, float(startup_timeout_s)
        self.max_start_failures = max_start_failures
        self.total_timeouts = 0
        self.total_crashes = 0
        self.total_cancelled = 0
        self._cv = threading.Condition()
        self._ids = itertools.count()
        self._queue: collections.deque[tuple[int, RewardItem, float]] = collections.deque()
        # (score, status, error, seconds, latency_s, info), in completion order
        self._results: dict[int, tuple[float, str, str, float, float, dict | None]] = {}
        self._submitted: dict[int, float] = {}  # id -> submit time, until its result
        self._cancelled: set[int] = set()  # running items whose result is to be dropped
        self._kill: set[int] = set()  # running items whose worker is to be killed (cancel)
        self._streamed: set[int] = set()  # ids from submit() not yet returned by poll()
        self._workers: list[_Worker] = []
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._started = self._closed = False
        self._wake_pending = False
        self._start_failures = 0
        self._logged = 0

    @classmethod
    def from_config(cls, section) -> RewardPool:
        """The pool a `jaxrl.config.train.RewardSection` describes (worker processes with hard per-item timeouts)."""
        return cls(num_workers=section.num_workers, timeout_s=section.timeout_s)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "RewardPool":
        """Start the workers and wait until all are ready (called by `__enter__`, or lazily)."""
        with self._cv:
            if self._closed:
                raise RuntimeError("RewardPool is closed")
            if self._started:
                return self
            self._started = True
        if self.num_workers == 0:
            return self
        ctx = self._ctx = self._context()
        self._wake_r, self._wake_w = ctx.Pipe(duplex=False)
        self._workers = [_Worker(ctx, self.startup_timeout_s) for _ in range(self.num_workers)]
        self._thread = threading.Thread(target=self._run, name="reward-pool", daemon=True)
        self._thread.start()
        with self._cv:
            self._cv.wait_for(lambda: self._error is not None or all(w.ready for w in self._workers),
                              timeout=self.startup_timeout_s * (self.max_start_failures + 1))
            error = self._error
            if error is None and not all(w.ready for w in self._workers):
                error = RuntimeError(f"reward workers not ready after {self.startup_timeout_s}s")
        if error is not None:
            self.close()
            raise error
        return self

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Wait until every worker is ready (one replaced after a timeout or a crash starts anew), at most
        `timeout_s` (default: the start-up timeout); True when all are. Items never need this (the dispatcher
        hands them to ready workers); a caller that times items from their submission does."""
        self.start()
        with self._cv:
            return self._cv.wait_for(lambda: self._closed or all(w.ready for w in self._workers),
                                     timeout=self.startup_timeout_s if timeout_s is None else timeout_s)

    def close(self) -> None:
        """Stop the dispatcher, let idle workers exit, SIGKILL the rest. Unfinished items are dropped."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        if self._thread is None:
            return
        self._wake()
        self._thread.join(timeout=10.0)
        idle = []
        for w in self._workers:
            if w.ready and w.item is None:
                try:
                    w.conn.send(None)  # ask idle workers to exit cleanly
                    idle.append(w)
                except (OSError, ValueError):
                    pass
        end = time.monotonic() + 1.0
        for w in idle:
            w.proc.join(timeout=max(0.0, end - time.monotonic()))
        for w in self._workers:
            w.kill()  # busy, starting, or slow to exit
        self._wake_r.close()
        self._wake_w.close()

    def _context(self):
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            ctx.set_forkserver_preload([__name__])  # no effect if the fork server already runs
        return ctx

    def __enter__(self) -> "RewardPool":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ API
    def submit(self, item: Sequence[str], *, timeout_s: float | None = None) -> int:
        """Queue one `(fn, response, answer, task[, extra])` item for `poll()`; returns its id.

        `timeout_s` overrides the pool's timeout for this item (e.g. the sum of a code response's adaptive
        per-test-case budgets). An unknown `fn` raises KeyError here, in the caller, not later in a worker.
        """
        return self._enqueue([item], stream=True, timeout_s=timeout_s)[0]

    def cancel(self, item_id: int, *, kill_running: bool = False) -> str:
        """Withdraw a submitted item; it will not appear in `poll()`. Returns where it was: "queued"
        (dropped), "running" (its result will be dropped; with `kill_running` its worker is killed and
        replaced now), "done" (scored, not yet polled: dropped) or "unknown" (already polled, or never
        submitted; nothing happens)."""
        with self._cv:
            if item_id not in self._streamed:
                return "unknown"
            self._streamed.discard(item_id)
            self._submitted.pop(item_id, None)
            self.total_cancelled += 1
            if self._results.pop(item_id, None) is not None:
                return "done"
            for k, (i, _, _) in enumerate(self._queue):
                if i == item_id:
                    del self._queue[k]
                    return "queued"
            self._cancelled.add(item_id)
            if kill_running and self.num_workers > 0:
                self._kill.add(item_id)
        self._wake()
        return "running"

    def poll(self, timeout: float = 0.0) -> list[RewardResult]:
        """Results of submitted items finished so far, in completion order; waits up to `timeout`
        seconds for at least one. Each id is returned once."""
        end = time.monotonic() + timeout
        with self._cv:
            while True:
                self._raise_if_broken()
                done = [i for i in self._results if i in self._streamed]
                left = end - time.monotonic()
                if done or left <= 0 or not self._streamed:
                    break
                self._cv.wait(min(left, _MAX_TICK_S))
            out = []
            for i in done:
                self._streamed.discard(i)
                out.append(RewardResult(i, *self._results.pop(i)))
            return out

    @property
    def num_pending(self) -> int:
        """Submitted items not yet returned by `poll()`."""
        with self._cv:
            return len(self._streamed)

    def score(self, items: Sequence[Sequence[str]]) -> tuple[np.ndarray, dict]:
        """Score a batch; blocks until every item has a result (each within its timeout of starting).

        Returns (scores float32 [len(items)], {"timeouts", "crashes", "seconds"}) for this batch.
        """
        t0 = time.monotonic()
        ids = self._enqueue(items, stream=False, timeout_s=None)
        with self._cv:
            left = set(ids)
            while True:
                left = {i for i in left if i not in self._results}
                if not left:
                    break
                self._raise_if_broken()
                self._cv.wait(_MAX_TICK_S)
            out = [self._results.pop(i) for i in ids]
        statuses = [r[1] for r in out]
        stats = dict(timeouts=statuses.count("timeout"), crashes=statuses.count("crash"),
                     seconds=time.monotonic() - t0)
        return np.asarray([r[0] for r in out], np.float32), stats

    def check(self, names: Sequence[str] | Mapping[str, Sequence[str] | None]) -> dict[str, str]:
        """{name: why it does not resolve} for the names that fail in a worker's environment: a fresh
        process started exactly as the workers are (same start method, fork server and `sys.path`)
        imports each one and checks its signature (`registry.problem`) against the columns `names` maps
        it to (names alone: the built-in rows' columns). In-process with `num_workers=0`. Waits at most
        `startup_timeout_s`; a name whose import hangs or kills the process is reported as such."""
        with self._cv:
            if self._closed:
                raise RuntimeError("RewardPool is closed")
        columns = dict(names) if isinstance(names, Mapping) else dict.fromkeys(names)
        names = list(columns)
        if self.num_workers == 0 or not names:
            return {n: p for n in names if (p := registry.problem(n, columns[n])) is not None}
        ctx = self._context()
        conn, child_conn = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_check_main, args=(child_conn, list(columns.items())), daemon=True,
                           name="reward-check")
        proc.start()
        child_conn.close()
        errors, done = {}, set()
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            while True:
                if not _mp_wait([conn], timeout=max(0.0, deadline - time.monotonic())):
                    why = f"import did not finish within {self.startup_timeout_s:g}s (startup_timeout_s)"
                    break
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    proc.join(timeout=5.0)
                    why = f"the process died while importing it ({_exit_text(proc.exitcode)})"
                    break
                if msg is None:
                    return errors
                name, problem = msg
                done.add(name)
                if problem is not None:
                    errors[name] = problem
            left = [n for n in names if n not in done]
            if left:
                errors[left[0]] = f"reward {left[0]!r}: {why}"
            return errors
        finally:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5.0)
            conn.close()

    # ------------------------------------------------------------------ internals
    def _enqueue(self, items, *, stream: bool, timeout_s: float | None) -> list[int]:
        items = [RewardItem(*it) for it in items]
        for it in items:
            registry.resolve(it.fn)  # fail fast on a typo
        t = self.timeout_s if timeout_s is None else float(timeout_s)
        if not t > 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        if not self._started:
            self.start()
        now = time.monotonic()
        inline = [self._score_inline(it) for it in items] if self.num_workers == 0 else None
        with self._cv:
            self._raise_if_broken()
            ids = [next(self._ids) for _ in items]
            if stream:
                self._streamed.update(ids)
            self._submitted.update((i, now) for i in ids)
            if inline is not None:
                for i, it, (score, status, detail, seconds, info) in zip(ids, items, inline):
                    self._finish(i, it.fn, score, status, detail, seconds, info)
                self._cv.notify_all()
                return ids
            self._queue.extend((i, it, t) for i, it in zip(ids, items))
        self._wake()
        return ids

    def _score_inline(self, it: RewardItem) -> tuple[float, str, str, float, dict | None]:
        t0 = time.monotonic()
        try:
            score, info = _call(it)
            return score, "ok", "", time.monotonic() - t0, info
        except Exception as e:
            return 0.0, "crash", _error_text(e), time.monotonic() - t0, None

    def _raise_if_broken(self) -> None:  # call with the lock held
        if self._error is not None:
            raise RuntimeError(f"RewardPool is broken: {self._error}") from self._error
        if self._closed:
            raise RuntimeError("RewardPool is closed")

    def _finish(self, item_id: int, fn: str, score: float, status: str, detail: str, seconds: float = 0.0,
                info: dict | None = None) -> None:
        """Record a result (lock held); the result of a cancelled item is dropped."""
        submitted = self._submitted.pop(item_id, None)
        if item_id in self._cancelled:
            self._cancelled.discard(item_id)
            self._kill.discard(item_id)
            return
        latency = time.monotonic() - submitted if submitted is not None else seconds
        self._results[item_id] = (score, status, detail, seconds, latency, info)
        if status == "ok":
            return
        if status == "timeout":
            self.total_timeouts += 1
        else:
            self.total_crashes += 1
        self._logged += 1
        level = logging.WARNING if self._logged <= _MAX_LOGGED else logging.DEBUG
        logger.log(level, "reward fn %r: %s (%s); scored 0%s", fn, status, detail,
                   "; further failures logged at DEBUG" if self._logged == _MAX_LOGGED else "")

    def _wake(self) -> None:
        with self._cv:
            if self._wake_pending or self._thread is None:
                return
            self._wake_pending = True
        try:
            self._wake_w.send_bytes(b"!")
        except (OSError, ValueError):
            pass

    def _run(self) -> None:
        try:
            while self._step():
                pass
        except BaseException as e:  # a dispatcher bug must surface in the caller, not hang it
            logger.exception("reward pool dispatcher died")
            with self._cv:
                self._error = self._error or e
                self._cv.notify_all()

    def _step(self) -> bool:
        """One dispatcher iteration: hand out work, wait for events or the nearest deadline, handle them."""
        sends = []
        with self._cv:
            if self._closed or self._error is not None:
                return False
            for w in self._workers:
                if self._queue and w.ready and w.item is None:
                    item_id, it, t = self._queue.popleft()
                    w.item, w.timeout_s, w.started = (item_id, it.fn), t, time.monotonic()
                    w.deadline = w.started + t
                    sends.append((w, (item_id, *it)))
            kill = set(self._kill)
        for w, msg in sends:
            try:
                w.conn.send(msg)
            except (OSError, ValueError):
                pass  # the worker is dead; its sentinel reports it below

        now = time.monotonic()
        wait_s = min([w.deadline - now for w in self._workers if w.item is not None or not w.ready]
                     + [_MAX_TICK_S])
        objs = [self._wake_r] + [w.conn for w in self._workers] + [w.proc.sentinel for w in self._workers]
        ready = set(_mp_wait(objs, timeout=max(0.0, wait_s)))

        if self._wake_r in ready:
            # Drain first, then clear the flag: clearing first lets a concurrent `_wake` set the flag and
            # send a byte that this drain swallows, after which every later `_wake` sees the flag set and
            # stays silent (submitted items then wait for the next 1 s tick).
            while self._wake_r.poll():
                self._wake_r.recv_bytes()
            with self._cv:
                self._wake_pending = False

        finished: list[tuple] = []  # (id, fn, score, status, detail, seconds, info)
        for k, w in enumerate(self._workers):
            dead = w.proc.sentinel in ready
            if w.conn in ready:
                try:
                    while w.conn.poll():
                        self._on_message(w, w.conn.recv(), finished)
                except (EOFError, OSError):
                    dead = True
            now = time.monotonic()
            if dead:
                w.proc.join(timeout=1.0)
                why = f"worker died ({_exit_text(w.proc.exitcode)})"
                if w.item is not None:
                    finished.append((*w.item, 0.0, "crash", why, now - w.started, None))
            elif w.item is not None and w.item[0] in kill:
                finished.append((*w.item, 0.0, "crash", "cancelled", now - w.started, None))  # dropped
                why = "cancelled"
            elif w.item is not None and now > w.deadline:
                finished.append((*w.item, 0.0, "timeout", f"timed out after {w.timeout_s:g}s", w.timeout_s, None))
            elif not w.ready and now > w.deadline:
                why = f"worker not ready after {self.startup_timeout_s}s"
            else:
                continue
            # replace the worker: dead, hung on an item, or stuck starting
            if not w.ready:
                self._start_failures += 1
                if self._start_failures > self.max_start_failures:
                    raise RuntimeError(f"reward worker failed to start {self._start_failures} times in a row "
                                       f"(last: {why})")
            w.kill()
            self._workers[k] = _Worker(self._ctx, self.startup_timeout_s)

        with self._cv:
            for item_id, fn, score, status, detail, seconds, info in finished:
                self._finish(item_id, fn, score, status, detail, seconds, info)
            self._cv.notify_all()
        return True

    def _on_message(self, w: _Worker, msg, finished: list) -> None:
        item_id, kind, payload = msg
        if item_id == "ready":
            w.ready, w.deadline = True, math.inf
            self._start_failures = 0
            with self._cv:
                self._cv.notify_all()
            return
        if w.item is None or w.item[0] != item_id:
            return  # stale reply (cannot happen with one item in flight; ignore defensively)
        seconds = time.monotonic() - w.started
        if kind == "ok":
            finished.append((*w.item, float(payload[0]), "ok", "", seconds, payload[1]))
        else:
            finished.append((*w.item, 0.0, "crash", payload, seconds, None))
        w.item, w.deadline = None, math.inf
