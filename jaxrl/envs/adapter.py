"""Environments written gym-style, adapted; and the start-up check of every environment's methods.

    class Guess:                               # no base class needed
        def reset(self, row):                  # the data row -> the opening text (or None, or gymnasium's (obs, info))
            self.secret = int(row["answer"])
        def step(self, text):                  # one turn's text -> (observation, reward, done)
            ok = text.strip() == str(self.secret)
            return ("" if ok else "<tool_response>no</tool_response>"), float(ok), ok

`make_env` wraps such an instance (one with callable `reset` and `step` that is not a `jaxrl.envs.Environment`) in
`GymEnv`, which maps:

* `reset(row)` -> the opening text: a str as it is, None as "", a 2-tuple `(obs, info)` (gymnasium) as `obs`. A
  `reset` with a parameter named `options` (gymnasium's `reset(self, *, seed=None, options=None)`) is called as
  `reset(options=row)`, any other as `reset(row)`.
* `step(text)` -> `Step`: `(observation, reward, done)`; `(observation, reward, done, info)` (gym before 0.26);
  gymnasium's `(observation, reward, terminated, truncated, info)` with done = terminated or truncated; a `Step`
  as it is. The observation is `str()`'d (None: ""). Anything else raises TypeError in the worker: that step is
  an environment error (`env_errors`), as for any failing step.

Simplified (stated): the tuple's `info` is dropped, not merged into `Step.info` (those are the runner's counters:
a user's keys would be summed into `env/` metrics or read as a step's status). The instance must be picklable,
as every environment is (it travels to the worker and back inside the `GymEnv`).

`env_problem(factory)` (called by `registry.env_factory`, so at start-up for every environment a run names): makes
one instance with no arguments and checks that `reset` takes the row and `step` one argument (for subclasses of
`Environment` too); the answer is one line naming the method and its signature, or None.
"""

from __future__ import annotations

import functools
import inspect

from .base import Environment, Step


class GymEnv(Environment):
    """A gym-style environment (see the module docstring) as an `Environment`."""

    def __init__(self, env):
        self.env = env
        self.by_options = _reset_by_options(type(env))

    def reset(self, row: dict):
        out = self.env.reset(options=row) if self.by_options else self.env.reset(row)
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
            out = out[0]             # gymnasium's (observation, info)
        return "" if out is None else out

    def step(self, action: str) -> Step:
        out = self.env.step(action)
        if isinstance(out, Step):
            return out
        if isinstance(out, tuple) and len(out) in (3, 4, 5):
            obs, reward, done = out[0], out[1], bool(out[2]) or (len(out) == 5 and bool(out[3]))
            return Step("" if obs is None else str(obs), reward, done)
        got = f"a {len(out)}-tuple" if isinstance(out, tuple) else f"a {type(out).__name__}"
        raise TypeError(f"{type(self.env).__name__}.step returned {got}; expected (observation, reward, done), "
                        "gymnasium's (observation, reward, terminated, truncated, info) or a jaxrl.envs.Step")


def adapt(env):
    """`env` as an `Environment` (a gym-style one wrapped in `GymEnv`), or None when it is neither."""
    if isinstance(env, Environment):
        return env
    if callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None)):
        return GymEnv(env)
    return None


@functools.lru_cache(maxsize=None)
def _reset_by_options(cls) -> bool:
    try:
        return "options" in inspect.signature(cls.reset).parameters
    except (TypeError, ValueError):
        return False


def env_problem(factory) -> str | None:
    """Why environments made by `factory` cannot run (see the module docstring), as one line; None when they can."""
    what = getattr(factory, "__qualname__", type(factory).__name__)
    try:
        inspect.signature(factory).bind()
    except TypeError:
        return f"{what}{_sig(factory)} needs arguments; name a class made with none, or a zero-argument factory"
    except ValueError:
        pass                                        # (no readable signature: try it)
    try:
        env = factory()
    except Exception as e:  # the user's constructor: whatever it raises is the cause
        return f"making one ({what}()) raised {type(e).__name__}: {e}"
    if adapt(env) is None:
        return (f"{what}() made a {type(env).__name__}, not an environment: a jaxrl.envs.Environment, or a "
                "gym-style class with reset(row) and step(text)")
    name = type(env).__name__
    gym = not isinstance(env, Environment) and _reset_by_options(type(env))
    calls = (("reset", {"options": {}} if gym else None, "reset(self, row)"),
             ("step", None, "step(self, text)"))
    for method, kwargs, want in calls:
        fn = getattr(env, method)
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            continue
        try:
            sig.bind(**kwargs) if kwargs else sig.bind("")
        except TypeError:
            return f"{name}.{method}{_bare(sig)} cannot be called as {want}"
    return None


def _sig(fn) -> str:
    """`fn`'s parameters without annotations."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return "(...)"
    return str(_bare(sig))


def _bare(sig: inspect.Signature) -> inspect.Signature:
    return sig.replace(parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
                       return_annotation=sig.empty)
