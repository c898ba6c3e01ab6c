"""Reward functions by name.

A reward function is a top-level (picklable, importable) function
`fn(response: str, answer: str, task: str) -> float`; the pool's worker processes look it up by name,
so nothing but strings crosses the process boundary.

Names are either keys of `REWARD_FNS` or an import path `"package.module:function"`. The import path is
the extension hook for rewards that do not belong in this table (and is how the tests reach the
misbehaving helpers in `jaxrl.rewards._testing`); the module must be importable in a fresh interpreter,
because workers are separate processes. Registering into `REWARD_FNS` at run time in the parent would
*not* reach workers, so there is deliberately no `register()`.
"""

from __future__ import annotations

import importlib
from typing import Callable

from .math import math_reward

RewardFn = Callable[[str, str, str], float]


def math_fn(response: str, answer: str, task: str) -> float:
    """Math verifier (`jaxrl.rewards.math.math_reward`); `task` is unused."""
    return math_reward(response, answer)


def builtin_fn(response: str, answer: str, task: str) -> float:
    """Verifier of the built-in synthetic tasks: `jaxrl.data.tasks.score(task, response, answer)`."""
    from jaxrl.data.tasks import score  # lazy: keeps the worker's import graph small

    return float(score(task, response, answer))


REWARD_FNS: dict[str, RewardFn] = {"math": math_fn, "builtin": builtin_fn}


def reward_fn_for(task: str) -> str:
    """Reward-function name for a task: `"math"` for the math task, `"builtin"` for every other task."""
    return "math" if task == "math" else "builtin"


def resolve(name: str) -> RewardFn:
    """The function for a registered name or a `"module:function"` import path; KeyError otherwise."""
    fn = REWARD_FNS.get(name)
    if fn is not None:
        return fn
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise KeyError(f"reward fn {name!r}: cannot import ({e})") from e
        if not callable(fn):
            raise KeyError(f"reward fn {name!r} is not callable")
        return fn
    raise KeyError(f"unknown reward fn {name!r}; valid choices: {', '.join(sorted(REWARD_FNS))} "
                   "or a 'package.module:function' import path")


def warmup() -> None:
    """Pay first-call costs (SymPy/LaTeX parser set-up, task imports) before a worker reports ready,
    so they never count against an item's timeout."""
    math_reward("\\boxed{\\frac{1}{2}}", "0.5")
    try:
        import jaxrl.data.tasks  # noqa: F401
    except ImportError:  # builtin_fn will then raise per item, scored as a crash
        pass
