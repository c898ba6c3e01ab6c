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
