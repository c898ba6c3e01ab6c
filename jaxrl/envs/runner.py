"""Stepping many trajectories' environments at once, each step in a reward worker process.

    runner = EnvRunner(pool, EnvLimits(max_turns=8, step_timeout_s=10.0, max_observation_chars=2000))
    runner.submit(key, env, action_text)          # as each trajectory's turn ends (non-blocking)
    for key, env, step in runner.poll(timeout=0.1):
        ...                                       # `env` after the step; `step` bounded and never raises

A step is a `RewardPool` item (`env_step` is its function): the pool's hard timeout, crash containment and
worker replacement apply, and the environment instance travels to the worker and back (`Environment`). Whatever
goes wrong in a step (the environment raises, hangs past `step_timeout_s`, kills its worker, returns something
other than a `Step`) the trajectory gets a bounded error observation, keeps the instance as it was before the
step, and the failure is counted (`env_errors`); the observation is cut to `max_observation_chars` in the
worker, so a tool printing megabytes never crosses the pipe. The runner ends a trajectory at `max_turns` turns.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

from .base import Environment, Step
from .tools import truncate

ITEM_FN = "jaxrl.envs.runner:env_step"


@dataclasses.dataclass(frozen=True)
class EnvLimits:
    """`max_turns`: model turns per trajectory (the last one ends it); `step_timeout_s`: one environment step's
    wall time in its worker; `max_observation_chars`: an observation's length at most."""

    max_turns: int = 8
    step_timeout_s: float = 10.0
    max_observation_chars: int = 2000

    def __post_init__(self):
        if not isinstance(self.max_turns, int) or self.max_turns < 1:
            raise ValueError(f"max_turns={self.max_turns!r} must be an int >= 1")
        if not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s={self.step_timeout_s} must be > 0")
        if not isinstance(self.max_observation_chars, int) or self.max_observation_chars < 64:
            raise ValueError(f"max_observation_chars={self.max_observation_chars!r} must be an int >= 64")


def env_step(action: str, answer: str, task: str, *, env: Environment, max_observation_chars: int):
    """The pool item: one step of `env` (in a worker). Returns (reward, {"env", "step"})."""
    step = env.step(action)
    if not isinstance(step, Step):
        raise TypeError(f"{type(env).__name__}.step returned {type(step).__name__}, not a Step")
    reward = float(step.reward)
    if not math.isfinite(reward):
        raise ValueError(f"{type(env).__name__}.step returned a non-finite reward {reward}")
    step = dataclasses.replace(step, observation=truncate(str(step.observation), max_observation_chars),
                               reward=reward, done=bool(step.done))
    return reward, {"env": env, "step": step}


class EnvRunner:
    """Environment steps through `pool` (a started `jaxrl.rewards.RewardPool`), under `limits`."""

    def __init__(self, pool, limits: EnvLimits = EnvLimits()):
        self.pool, self.limits = pool, limits
        self._items: dict[int, tuple] = {}       # pool item id -> (key, env before the step, turn)
        self.turns: Counter = Counter()          # key -> turns stepped so far
        self.totals: Counter = Counter()         # env/ counters over the runner's life

    def submit(self, key, env: Environment, action: str) -> None:
        """Step trajectory `key`'s `env` with one turn's text (its result comes out of `poll`)."""
        self.turns[key] += 1
        item = (ITEM_FN, action, "", "", {"env": env, "max_observation_chars": self.limits.max_observation_chars})
        self._items[self.pool.submit(item, timeout_s=self.limits.step_timeout_s)] = (key, env, self.turns[key])

    def cancel(self, key) -> None:
        """Withdraw trajectory `key`'s step in flight, if any (its result never comes out of `poll`)."""
        for item_id, (k, _, _) in list(self._items.items()):
            if k == key:
                del self._items[item_id]
                self.pool.cancel(item_id)         # (a running step finishes or times out; its result is dropped)
        self.turns.pop(key, None)

    def forget(self, key) -> None:
        """Trajectory `key` is over (whatever ended it): its turn count goes (a later trajectory may reuse the key)."""
        self.turns.pop(key, None)

    @property
    def pending(self) -> int:
        return len(self._items)

    def poll(self, timeout: float = 0.0) -> list[tuple]:
        """`(key, env, Step)` for each step finished so far (waits up to `timeout` for one)."""
        out = []
        for r in self.pool.poll(timeout):
            if r.id not in self._items:         # (cancelled)
                continue
            key, env, turn = self._items.pop(r.id)
            if r.status == "ok":
                env, step = r.info["env"], r.info["step"]
            else:                   # the instance from before the step; the error as the observation
                error = f"<tool_response>environment error: {r.error}</tool_response>"
                step = Step(truncate(error, self.limits.max_observation_chars),
                            info={"env_errors": 1, "status": r.status})
            if turn >= self.limits.max_turns and not step.done:
                step = dataclasses.replace(step, done=True, info={**step.info, "turn_limit": 1})
            if step.done:
                self.turns.pop(key, None)
            self.totals.update({k: v for k, v in step.info.items() if isinstance(v, (int, float))})
            self.totals["steps"] += 1
            out.append((key, env, step))
        return out
