"""Rewards on the simulator's clock: a `RewardPool` stand-in whose workers take virtual time.

`rl.rollout_and_score` and `rl.score_batch` (the trainer's own functions) drive it through the real
`RewardScheduler`, exactly as they drive the process pool: `submit` as each response finishes, `poll`
every engine step, `cancel` for responses given up, `poll(timeout)` to wait at the end (which advances
the clock to the next result, since nothing else happens meanwhile).

An item is scored by the workload: `SimTokenizer.decode` writes a simulated response as "sample:length",
the row's answer is the prompt index, so the pool knows which response of which prompt it scores. It
runs `workload.reward_seconds` on the first free worker (FIFO over `workers`, as the process pool serves
them). A code task's response runs under a timeout from `rewards.timeouts.AdaptiveTimeouts` (the trainer's
own policy, one test case per prompt; `adaptive=False` keeps T_max): a program that runs longer, or never
terminates, is killed at the timeout and scores 0; a correct run moves its prompt's anchor.

Simplified (stated): a cancelled item keeps the worker time it was given (the real pool frees a queued
item's slot and kills a running code item at once); results come back in completion order.
"""

from __future__ import annotations

import heapq
import itertools
import math

from jaxrl.rewards.pool import RewardResult
from jaxrl.rewards.timeouts import AdaptiveTimeouts

from .engine import Clock, sample_of
from .workload import Workload


class SimTokenizer:
    """What `rollout_and_score` decodes a simulated response with: "sample:length"."""

    eos_ids = (1,)

    def decode(self, tokens) -> str:
        return f"{sample_of(tokens)}:{len(tokens)}"


class SimRewardPool:
    """A `RewardPool` on the virtual clock (see the module docstring)."""

    def __init__(self, clock: Clock, workload: Workload, *, workers: int = 8, timeout_s: float = 30.0,
                 timeouts: AdaptiveTimeouts | None = None, timeline=None):
        if workers < 1:
            raise ValueError(f"workers={workers} must be >= 1")
        self.clock, self.workload, self.timeout_s = clock, workload, float(timeout_s)
        self.timeouts = timeouts if timeouts is not None else AdaptiveTimeouts(t_max=timeout_s, enabled=False)
        self.timeline = timeline
        self._free = [0.0] * workers                    # when each worker is next free (a heap)
        self._ids = itertools.count()
        self._pending: dict[int, tuple[float, RewardResult]] = {}
        self.busy_s = 0.0
        self.timed_out = 0

    def submit(self, item, *, timeout_s: float | None = None) -> int:
        fn, response, answer, task = item[:4]
        sample, length = (int(x) for x in str(response).split(":"))
        index = int(answer)
        wl = self.workload
        seconds = wl.reward_seconds(index, sample)
        score = wl.reward(index, sample)
        now = self.clock()
        start = max(now, heapq.heappop(self._free))
        status, error = "ok", ""
        if wl.is_code(index):
            limit = self.timeouts.timeout_for(str(index))
            if seconds > limit:
                seconds, score, status, error = limit, 0.0, "timeout", f"ran past {limit:.3g} s"
                self.timed_out += 1
            elif score > 0:
                self.timeouts.observe(str(index), seconds, correct=True)
        elif not math.isfinite(seconds):
            seconds, score, status = self.timeout_s, 0.0, "timeout"
        end = start + seconds
        heapq.heappush(self._free, end)
        self.busy_s += seconds
        if self.timeline is not None and seconds:
            self.timeline.add("reward", "reward", start, end)
        rid = next(self._ids)
        self._pending[rid] = (end, RewardResult(rid, score, status, error, seconds, end - now))
        return rid

    def cancel(self, item_id: int, *, kill_running: bool = False) -> str:
        got = self._pending.pop(item_id, None)
        if got is None:
            return "unknown"
        return "running" if got[0] > self.clock() else "done"

    def poll(self, timeout: float = 0.0) -> list[RewardResult]:
        if timeout > 0 and self._pending:
            first = min(end for end, _ in self._pending.values())
            if first > self.clock():
                self.clock.advance(min(first, self.clock() + timeout) - self.clock())
        now = self.clock()
        done = sorted((end, r.id) for r_id, (end, r) in self._pending.items() if end <= now)
        return [self._pending.pop(i)[1] for _, i in done]

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def idle_at(self) -> float:
        """When every worker is free (the end of the last submitted item)."""
        return max(self._free)
