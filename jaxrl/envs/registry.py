"""Environments by name: a built-in (`ENVS`) or an import path, as rewards are named (`rollout.env`, or a data
row's own `"env"` field).

    make = env_factory("calculator")              # or "my_envs:Guess": a class or a zero-argument factory
    env = make_env("my_envs:Guess")               # one trajectory's Environment (a gym-style one adapted)

`env_factory` also checks what the factory makes (`adapter.env_problem`: one instance made, its `reset` and `step`
arity), once per factory, so a wrong environment stops the run at start-up (`MultiTurn` resolves every name the
data uses) rather than at the first RL step. A gym-style class (`reset(row)`, `step(text) -> (obs, reward, done)`,
no base class) is adapted by `make_env` (`adapter.GymEnv`).
"""

from __future__ import annotations

import functools
import importlib
from typing import Callable

from .adapter import adapt, env_problem
from .base import Environment
from .tools import ToolEnv

ENVS: dict[str, Callable[[], Environment]] = {
    "tools": ToolEnv,                                           # calculator and python, the row's reward
    "calculator": lambda: ToolEnv(tools=("calculator",)),       # the calculator only (the `calc` task)
}


def env_factory(name: str) -> Callable[[], Environment]:
    """What makes one trajectory's environment: a built-in name or `"package.module:attr"`, where `attr` is an
    `Environment` subclass, a gym-style class, or a function of no arguments returning either. Raises ValueError
    naming what is wrong: it does not import, or what it makes cannot run (`adapter.env_problem`)."""
    factory = _factory(name)
    problem = _checked(factory)
    if problem is not None:
        raise ValueError(f"environment {name!r}: {problem}")
    return factory


def _checked(factory) -> str | None:
    try:
        return _cached_problem(factory)
    except TypeError:        # an unhashable factory: checked every time
        return env_problem(factory)


@functools.lru_cache(maxsize=None)
def _cached_problem(factory) -> str | None:
    return env_problem(factory)


def _factory(name: str) -> Callable[[], Environment]:
    if not isinstance(name, str) or not name:
        raise ValueError(f"environment name {name!r}: a built-in ({', '.join(sorted(ENVS))}) or 'package.module:Env'")
    if name in ENVS:
        return ENVS[name]
    module, _, attr = name.partition(":")
    if not attr:
        raise ValueError(f"unknown environment {name!r}: a built-in ({', '.join(sorted(ENVS))}) or "
                         "'package.module:Env' (a class or a zero-argument factory)")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"environment {name!r} does not import: {type(e).__name__}: {e}") from None
    if not callable(obj):
        raise ValueError(f"environment {name!r} is a {type(obj).__name__}, not a class or a factory")
    return obj


def make_env(name: str) -> Environment:
    """One new environment instance of `name`, a gym-style one wrapped in `adapter.GymEnv` (TypeError when the
    factory makes something else)."""
    env = env_factory(name)()
    adapted = adapt(env)
    if adapted is None:
        raise TypeError(f"environment {name!r} made a {type(env).__name__}, not a jaxrl.envs.Environment or a "
                        "gym-style class with reset(row) and step(text)")
    return adapted


def env_name(row: dict, default: str | None) -> str | None:
    """The environment of data row `row`: its own `"env"` field, else `default` (`rollout.env`)."""
    return row.get("env") or default
