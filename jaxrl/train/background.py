"""A cold start's remaining executables compiled on a thread, so that the first RL step comes sooner
(`trainer.background_compile`, on by default; `warm_up.py` starts it).

    bg = BackgroundCompile.start(first, later)   # each job: job(stop) -> compiled count
    ...                            # first: what step 0 runs (each home instance's cover shapes, the update),
                                   # compiled while the supervised warm start runs (`warm_up.start_early`);
                                   # step 0's rollout rounds every step up to the cover shapes, and its
                                   # update waits only for the executables it runs (never compiles twice)
    wait_s = bg.finish(svc)        # before step 1's rollout: the exact buckets (`later`) compile now, on
                                   # every core, then every instance runs on them
    bg.close()                     # a run that ends first: stop after the compilations in progress, join

A warm-up compiles every shape a run can use before its first step (tests/test_bounded_shapes.py): on a cold
cache, most of a short run's time to its first metrics (docs/benchmarks.md, "Cold start"). Here only what
step 0 runs compiles before it, and beside the warm start where there is one. The exact buckets wait for
step 0 to end: on a host whose cores the warm start and step 0 keep busy (2 CPU cores), compiling them
meanwhile only slowed those down (the first step 47 s either way, measured); after it, step 1 waits for
them once, compiled `compile_workers()` at a time, and no RL step after the first compiles.

Which rollout runs on the cover is fixed (step 0's, a run starting at step 0), never "whichever ran before
the thread was done": a row's float32 log-probs depend on its bucket by rounding, so this keeps a run
reproducible and a resumed run equal to an uninterrupted one (a run resumed at a later step warms up
whole, as a run without this does). Layouts other than the home one (PAT's warmed layouts, a scale-up's
pool, the stream trainer's freed devices) still compile before step 0.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence

from jaxrl.rollout.executor import compile_workers
from jaxrl.runtime import CompileCounter

Job = Callable[[threading.Event], int]


class BackgroundCompile:
    def __init__(self, jobs: Sequence[Job], later: Sequence[Job] = ()):
        self.jobs, self.later, self.stop, self.go = list(jobs), list(later), threading.Event(), threading.Event()
        self.compiled, self.seconds, self.error = 0, 0.0, None
        self.thread = threading.Thread(target=self._run, name="jaxrl-background-compile", daemon=True)

    @classmethod
    def start(cls, jobs: Sequence[Job], later: Sequence[Job] = ()) -> "BackgroundCompile":
        """Run `jobs` on a thread now, one after another, and `later` once `finish` is called."""
        bg = cls(jobs, later)
        bg.thread.start()
        return bg

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            for job in self.jobs:
                self.compiled += self._one(job)
            self.go.wait()
            if self.later and not self.stop.is_set():
                with concurrent.futures.ThreadPoolExecutor(min(len(self.later), compile_workers())) as pool:
                    self.compiled += sum(pool.map(self._one, self.later))
        except BaseException as e:       # re-raised by finish(): the step that needs it names the failure
            self.error = e
        self.seconds = time.perf_counter() - t0

    def _one(self, job: Job) -> int:
        with CompileCounter.background():
            return 0 if self.stop.is_set() else job(self.stop)

    def finish(self, svc) -> float:
        """Compile the `later` jobs (the main thread waits), then put `svc`'s instances on their exact buckets;
        returns the seconds waited."""
        t0 = time.perf_counter()
        self.go.set()
        self.thread.join()
        if self.error is not None:
            raise RuntimeError("the background compilation of the warm-up failed") from self.error
        for inst in svc.instances:
            inst.use_exact()
        return time.perf_counter() - t0

    def close(self) -> None:
        """Stop after the compilations in progress and join (XLA must not be compiling at interpreter exit)."""
        self.stop.set()
        self.go.set()
        self.thread.join()
