"""A cold start's remaining executables compiled on a thread while the first RL step runs
(`trainer.background_compile`, on by default; `warm_up.py` starts it).

    bg = BackgroundCompile.start([update_job, *exact_bucket_jobs])   # each job: job(stop) -> compiled count
    ...                            # step 0: the rollout rounds every step up to its instance's cover shapes;
                                   # the update waits only for the executables it runs (never compiles twice)
    wait_s = bg.finish(svc)        # before step 1's rollout: join, then every instance on its exact buckets
    bg.close()                     # a run that ends first: stop after the compilation in progress, join

A warm-up compiles every shape a run can use before its first step (tests/test_bounded_shapes.py): on a cold
cache, most of a short run's time to its first metrics (docs/benchmarks.md, "Cold start"). Here only the cover
shapes block (the
largest decode bucket, one prefill bucket per chunk width: `ShapeBuckets.coarse`), and the update's
executables and the exact buckets compile on this thread meanwhile. Step 0's rollout is slower for it (every
decode step padded to the largest bucket; the thread takes a core on a 2-core host); the first metrics come
sooner. The run then waits here, once, for whatever is left, so no RL step after the first compiles.

Which rollout runs on the cover is fixed (step 0's, a run starting at step 0), never "whichever ran before
the thread was done": a row's float32 log-probs depend on its bucket by rounding, so this keeps a run
reproducible and a resumed run equal to an uninterrupted one (a run resumed at a later step warms up
whole, as a run without this does). Layouts other than the home one (PAT's warmed layouts, a scale-up's
pool, the stream trainer's freed devices) still compile before step 0.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from jaxrl.runtime import CompileCounter

Job = Callable[[threading.Event], int]


class BackgroundCompile:
    def __init__(self, jobs: Sequence[Job]):
        self.jobs, self.stop = list(jobs), threading.Event()
        self.compiled, self.seconds, self.error = 0, 0.0, None
        self.thread = threading.Thread(target=self._run, name="jaxrl-background-compile", daemon=True)

    @classmethod
    def start(cls, jobs: Sequence[Job]) -> "BackgroundCompile":
        bg = cls(jobs)
        bg.thread.start()
        return bg

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            with CompileCounter.background():
                for job in self.jobs:
                    if self.stop.is_set():
                        break
                    self.compiled += job(self.stop)
        except BaseException as e:       # re-raised by finish(): the step that needs it names the failure
            self.error = e
        self.seconds = time.perf_counter() - t0

    def finish(self, svc) -> float:
        """Wait for every job, then put `svc`'s instances on their exact buckets; returns the seconds waited."""
        t0 = time.perf_counter()
        self.thread.join()
        if self.error is not None:
            raise RuntimeError("the background compilation of the warm-up failed") from self.error
        for inst in svc.instances:
            inst.use_exact()
        return time.perf_counter() - t0

    def close(self) -> None:
        """Stop after the compilation in progress and join (XLA must not be compiling at interpreter exit)."""
        self.stop.set()
        self.thread.join()
