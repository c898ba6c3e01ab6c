"""Misbehaving tools and environments for the runner's tests (reach tools as `"jaxrl.envs._testing:NAME"`).

They live in the package, not in the test module, because worker processes must import them by name.
Never used outside tests.
"""

from __future__ import annotations

import os
import time

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
