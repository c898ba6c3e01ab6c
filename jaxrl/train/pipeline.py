"""StreamRL's disaggregated generation and training (paper §4.1): device pools, the train worker, the
asynchronous rollouts made ahead and the per-pool busy timeline.

    train_devs, gen_devs, spare = split_devices(train_size=4, gen_per_process=4)   # disjoint pools
    worker = TrainWorker(timeline)           # the train pool's host thread (one, FIFO)
    gs = GradientStream(..., executor=worker)   # dynamic-batch pipelining: grads as groups arrive
    fut = worker.submit("update", fn)        # asynchronous: step n's update while rollouts n+1..n+k run

**Pools.** `placement=disaggregated`: each process gives its first train_size / process_count local
devices to the train mesh (over all processes) and the next `engine.tp × engine.instances` to its
generation instances; `stage_balance.max_instances` adds spare groups after those. Colocated: both use
every device.

**Train worker.** The train pool's work (packing micro-batches, dispatching gradient steps, the update)
runs on one host thread, FIFO, and each task blocks until its device work is done, so the generation
loop on the main thread never waits for training, and each span the worker records is the device's
busy time (the CPU cannot overlap the two pools in wall time: 8 fake devices share 2 cores; on real
devices the pools run in parallel).

**Dynamic-batch pipelining (synchronous mode).** Completed, scored groups go to the gradient stream on
the train pool as they arrive (`GradientStream`, fixed micro-batches: the batch of each gradient
dispatch is set by arrival, its shape never changes); after the rollout the remaining samples run, the
sums are divided by D once and one update is applied: the synchronous update up to float32 summation
order. Weights then go to the generation pool layer by layer (`RolloutService.update_weights`,
asynchronous dispatch: the trainer does not wait for it).

**Asynchronous (`trainer.max_staleness=k`, k = 1 is StreamRL's one-step-async).** Step n's update runs on the
train worker while the main thread rolls out the steps up to n+k not made yet (`RolloutSide.run_ahead`) with
the weights the generation pool holds. Their samples carry the rollout's own log-probs as the behaviour
policy (`old_logp`, or `behav_logp` for the decoupled objective: `corrections.py`) and the version of the
weights that generated each token; staleness (version trained − version generated) is checked to be at most
k and recorded per step. The rollouts made ahead (tokens, log-probs, versions, rewards, rows) are saved in the
checkpoint, so a resumed run trains exactly the samples the uninterrupted one would. With
`trainer.swap_step`, the update enters the next rollout mid-way (`weight_swap.py`). Asynchronous RL as a
whole: docs/async.md.

Simplified versus the paper: one process drives both pools (multi-controller over processes as in
the rest of the system: each process has both pools; with several processes the synchronous mode trains
after the rollout instead of streaming, since every process's gradient dispatches would have to agree
in number); weights are not broadcast over a tree of ranks but resharded device to device.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable

import jax
import numpy as np

from jaxrl.rollout import Completion
from jaxrl.rollout.tail_batching import RoundPlan


# ----------------------------------------------------------------------------------------------- pools
def split_devices(*, train_size: int, gen_per_process: int, spare_per_process: int = 0,
                  devices=None) -> tuple[list, list, list]:
    """(train devices over every process, this process's generation devices, this process's spare
    devices) for placement=disaggregated; disjoint. Raises naming the counts when they do not fit."""
    devices = list(jax.devices() if devices is None else devices)
    procs = sorted({d.process_index for d in devices})
    if train_size % len(procs):
        raise ValueError(f"train_layout of {train_size} devices does not divide over {len(procs)} processes")
    per = train_size // len(procs)
    train, gen, spare = [], [], []
    for p in procs:
        local = sorted((d for d in devices if d.process_index == p), key=lambda d: d.id)
        need = per + gen_per_process + spare_per_process
        if len(local) < need:
            raise ValueError(f"placement=disaggregated: process {p} has {len(local)} devices; it needs {per} for "
                             f"training + {gen_per_process} for generation + {spare_per_process} spare = {need}")
        train += local[:per]
        if p == jax.process_index():
            gen = local[per:per + gen_per_process]
            spare = local[per + gen_per_process:need]
    return train, gen, spare


# ----------------------------------------------------------------------------------------------- timeline
@dataclasses.dataclass
class Span:
    pool: str          # "gen" | "train"
    kind: str          # "decode", "grad", "update", "sync", ...
    start: float
    end: float
    step: int


class Timeline:
    """Busy spans per device pool, seconds since the timeline started (thread-safe)."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.spans: list[Span] = []
        self.step = 0
        self._lock = threading.Lock()

    def add(self, pool: str, kind: str, start: float, end: float) -> None:
        with self._lock:
            self.spans.append(Span(pool, kind, start - self.t0, end - self.t0, self.step))

    def busy(self, pool: str) -> float:
        return sum(s.end - s.start for s in self.spans if s.pool == pool)

    def to_json(self) -> list[dict]:
        return [dataclasses.asdict(s) for s in sorted(self.spans, key=lambda s: s.start)]


# ----------------------------------------------------------------------------------------------- worker
class TrainWorker:
    """One host thread for the train pool's work, in submission order; each task blocks until its device
    work is done, and its span goes to the timeline (when one is given)."""

    def __init__(self, timeline: Timeline | None = None):
        self.timeline = timeline
        self.busy_s = 0.0          # device-busy seconds of the tasks so far (`take_busy` reads and resets)
        self._ex = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="train-pool")

    def submit(self, kind: str, fn: Callable, *args, **kwargs) -> concurrent.futures.Future:
        def task():
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            jax.block_until_ready(out)
            end = time.perf_counter()
            self.busy_s += end - start
            if self.timeline is not None:
                self.timeline.add("train", kind, start, end)
            return out

        return self._ex.submit(task)

    def take_busy(self) -> float:
        """Busy seconds since the last call (after waiting for the tasks submitted so far)."""
        self.barrier()
        busy, self.busy_s = self.busy_s, 0.0
        return busy

    def barrier(self) -> None:
        """Wait for every task submitted so far (re-raising the first failure). From inside a task it
        returns at once: the tasks before it are done (FIFO)."""
        if threading.current_thread().name.startswith("train-pool"):
            return
        self._ex.submit(lambda: None).result()

    def close(self) -> None:
        self._ex.shutdown(wait=True)


# ----------------------------------------------------------------------------------------------- async buffer
@dataclasses.dataclass
class Prefetched:
    """A rollout (asynchronous: of a later step, made while an earlier one trained) with the weights version
    its rollout started on (its tokens' own versions: `Completion.versions`)."""

    step: int
    version: int
    rows: list[dict]
    completions: list          # rollout.Completion
    rewards: np.ndarray
    stats: dict
    plan: RoundPlan | None = None      # tail batching's round plan (saved: a resumed step's tail/ metrics)

    def state_dict(self) -> dict:
        comps = [{"request_id": c.request_id, "prompt": list(c.prompt), "tokens": list(c.tokens),
                  "logprobs": [float(x) for x in c.logprobs], "finish_reason": c.finish_reason,
                  "instance": c.instance, "preemptions": c.preemptions,
                  "appended": [list(span) for span in c.appended],
                  "versions": [list(span) for span in c.versions]} for c in self.completions]
        stats = {k: v for k, v in self.stats.items() if isinstance(v, (int, float, str, list))}
        if "env" in self.stats:                 # multi-turn counters (env/ metrics)
            stats["env"] = {k: float(v) for k, v in self.stats["env"].items()}
        if "mechanisms" in self.stats:          # the rollout side's metrics (tail/queue_len, planner/, pat/)
            stats["mechanisms"] = {k: int(v) if isinstance(v, (int, np.integer)) else float(v)
                                   for k, v in self.stats["mechanisms"].items()}
        return {"step": self.step, "version": self.version, "rows": self.rows, "completions": comps,
                "rewards": [float(r) for r in self.rewards], "stats": stats,
                "plan": None if self.plan is None else dataclasses.asdict(self.plan)}

    @classmethod
    def from_state(cls, d: dict) -> "Prefetched":
        comps = [Completion(c["request_id"], c["prompt"], c["tokens"], c["logprobs"], c["finish_reason"],
                            c["instance"], c["preemptions"], appended=[tuple(span) for span in c.get("appended", [])],
                            versions=[tuple(span) for span in c.get("versions", [])])
                 for c in d["completions"]]
        plan = None if d.get("plan") is None else RoundPlan(**d["plan"])
        return cls(int(d["step"]), int(d["version"]), list(d["rows"]), comps,
                   np.asarray(d["rewards"], np.float32), dict(d["stats"]), plan)


def check_staleness(trained_version: int, sample_versions, bound: int) -> int:
    """Versions behind (trained − generated) of a step's samples: the largest; more than `bound`
    (trainer.max_staleness) is a bug."""
    lag = max((trained_version - int(v) for v in sample_versions), default=0)
    if not 0 <= lag <= bound:
        raise RuntimeError(f"trained version {trained_version} on samples of versions "
                           f"{sorted(set(map(int, sample_versions)))}: staleness {lag} (must be 0..{bound})")
    return lag
