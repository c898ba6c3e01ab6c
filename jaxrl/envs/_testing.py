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


class GymGuess:
    """Gym-style, no base class: `reset(row)` returns None, `step` the 3-tuple (observation, reward, done)."""

    def reset(self, row):
        self.answer, self.tries = row["answer"], 0

    def step(self, text):
        self.tries += 1
        ok = text.strip() == self.answer
        return ("" if ok else f"no ({self.tries})"), 1.0 / self.tries if ok else 0.0, ok


class GymnasiumStyle:
    """Gymnasium's signatures: `reset(*, seed=None, options=None)` -> (obs, info) with the row as `options`;
    `step` -> (obs, reward, terminated, truncated, info), truncated at the second step."""

    def reset(self, *, seed=None, options=None):
        self.n, self.prompt = 0, options["prompt"]
        return " [start]", {"seed": seed}

    def step(self, action):
        self.n += 1
        return f"{self.prompt}#{self.n}", 0.5, False, self.n >= 2, {"status": "not a runner status"}


class ResetWithoutRow:
    """Wrong arity: its reset takes no row."""

    def reset(self):
        return ""

    def step(self, text):
        return "", 0.0, True


class StepWithoutText(Environment):
    """Wrong arity on a subclass: its step takes no text."""

    def step(self):
        return Step(done=True)
