"""Environments by name: a built-in (`ENVS`) or an import path, as rewards are named (`rollout.env`, or a data
row's own `"env"` field).

    make = env_factory("calculator")              # or "my_envs:Guess": a class or a zero-argument factory
    env = make()                                  # one trajectory's Environment
"""

from __future__ import annotations

import importlib
from typing import Callable

from .base import Environment
from .tools import ToolEnv

ENVS: dict[str, Callable[[], Environment]] = {
    "tools": ToolEnv,                                           # calculator and python, the row's reward
    "calculator": lambda: ToolEnv(tools=("calculator",)),       # the calculator only (the `calc` task)
}


def env_factory(name: str) -> Callable[[], Environment]:
    """What makes one trajectory's environment: a built-in name or `"package.module:attr"`, where `attr` is an
    `Environment` subclass or a function of no arguments returning one. Raises ValueError naming what is wrong."""
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
    """One new environment instance of `name` (TypeError when the factory makes something else)."""
    env = env_factory(name)()
    if not isinstance(env, Environment):
        raise TypeError(f"environment {name!r} made a {type(env).__name__}, not a jaxrl.envs.Environment")
    return env


def env_name(row: dict, default: str | None) -> str | None:
    """The environment of data row `row`: its own `"env"` field, else `default` (`rollout.env`)."""
    return row.get("env") or default
