"""Misbehaving tools and environments for the runner's tests (reach tools as `"jaxrl.envs._testing:NAME"`).

They live in the package, not in the test module, because worker processes must import them by name.
Never used outside tests.
"""

from __future__ import annotations

import os
import time

from jaxrl.data.tasks import builtin_reward

from .base import Environment, Step


def raises(**kw) -> str:
    raise ZeroDivisionError("deliberate failure in a tool")


def hangs(**kw) -> str:
    time.sleep(3600)
    return "never"


def floods(**kw) -> str:
    return "x" * 10_000_000


def malformed(**kw):
    return {"not": "text", "nested": [1, 2, {3}]}


def exits(**kw) -> str:
    os._exit(3)


class Counter(Environment):
    """Counts its steps; the trajectory ends at the third (checks that the instance travels)."""

    def __init__(self):
        self.n = 0

    def step(self, action: str) -> Step:
        self.n += 1
        return Step(observation=f"step {self.n}: {action}", reward=float(self.n), done=self.n == 3)


class Broken(Environment):
    def step(self, action: str):
        return "not a Step"


def exact(response: str, answer: str, task: str) -> float:
    """A reward: 1 when the response is the answer."""
    return float(response.strip() == answer)


class Echo(Environment):
    """Never ends a trajectory itself (the runner's max_turns does): each turn's observation is a short
    acknowledgement and its reward the change in the built-in score of the latest turn against the row's answer
    (so a trajectory's reward is its last turn's score); `reset` opens with " go" when the prompt ends with "?"."""

    def __init__(self):
        self.n, self.score, self.answer, self.task = 0, 0.0, "", "copy"

    def reset(self, row: dict) -> str:
        self.answer, self.task = row["answer"], row["task"]
        return " go" if row["prompt"].endswith("?") else ""

    def step(self, action: str) -> Step:
        self.n += 1
        score = builtin_reward(action, self.answer, self.task)
        reward, self.score = score - self.score, score
        return Step(observation=f"ok{self.n}", reward=reward)
