"""Misbehaving reward functions for the pool's tests (reach them as `"jaxrl.rewards._testing:NAME"`).

They live in the package, not in the test module, because worker processes must import them by name.
Not registered in `REWARD_FNS` and never used outside tests.
"""

from __future__ import annotations

import ctypes
import os
import time


def sleep_forever(response: str, answer: str, task: str) -> float:
    time.sleep(3600)
    return 1.0


def sleep_then_one(response: str, answer: str, task: str) -> float:
    """Sleeps `float(response)` seconds, then scores 1 (for timing/ordering tests)."""
    time.sleep(float(response))
    return 1.0


def crash_exit(response: str, answer: str, task: str) -> float:
    os._exit(3)


def segfault(response: str, answer: str, task: str) -> float:
    ctypes.string_at(0)  # reads address 0: a real SIGSEGV, no Python exception
    return 1.0


def raise_error(response: str, answer: str, task: str) -> float:
    raise RuntimeError("deliberate failure in a reward fn")


def return_nan(response: str, answer: str, task: str) -> float:
    return float("nan")


# ---------------------------------------------------------------- signatures (jaxrl.rewards.calling): what a call sees
def rowwise(response: str, answer: str, *, prompt: str, difficulty) -> tuple[float, dict]:
    """Takes the prompt and a column by name; scores the difficulty and reports what it got."""
    return float(difficulty), {"response": response, "answer": answer, "prompt": prompt}


def takes_all(response: str, answer: str, task: str, **row) -> tuple[float, dict]:
    """`**row`: every other value of the row; reports them."""
    return float(len(row)), {"row": row}


def old_style(response: str, answer: str, task: str) -> tuple[float, dict]:
    """Today's signature (any keyword argument would be a TypeError); reports its three values."""
    return 1.0, {"args": [response, answer, task]}


def trl_style(completions, prompts, **kwargs) -> list[float]:
    """TRL's batched form: one-element lists in, a list of one score out (10 x difficulty + the response's length)."""
    assert len(completions) == len(prompts) == 1 and all(len(v) == 1 for v in kwargs.values()), (completions, kwargs)
    return [10.0 * kwargs["difficulty"][0] + len(completions[0])]


def no_positional(*, prompt: str) -> float:
    return 1.0
