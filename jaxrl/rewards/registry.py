"""Reward functions by name, how each row of the data picks one, and the item that scores a response.

A reward function is a top-level (picklable, importable) function `fn(response: str, answer: str, task: str)
-> float`, which may also take the row's prompt and any of its columns by name
(`fn(response, answer, *, prompt, difficulty)`, `fn(response, answer, task, **row)`) or be written in TRL's
batched form (`fn(completions, **kwargs) -> list[float]`): `jaxrl.rewards.calling` has the rules. The pool's
worker processes look it up by name, so only the name and the values it takes cross the process boundary:
`reward_item(name, response, row)` builds that item (every place that scores a row's response calls it).

**Plugging in your own reward.** Write the function in a module that a fresh interpreter can import
(a file in the directory the run starts from with `python -m jaxrl.train ...`, or a directory on
`PYTHONPATH`, or an installed package), then name it as `"package.module:function"` in any of:

* the row's own `"reward"` field in the JSONL/Parquet data (a per-row choice),
* `rewards.fn` in the training config (every row without its own field),
* `rewards.registry` (short names -> import paths: `registry: {mine: my_rewards:score}` lets rows and
  `rewards.fn` say `mine`).

`reward_name(row, fn, registry)` applies that order (row > `rewards.fn` > the task's default: "math"
for math rows, "code" for code rows, "builtin" for the built-in tasks, `reward_fn_for`) and replaces a
registry name by its import path, which is what the workers resolve.
`check_rewards(reward_columns(rows, fn, registry), pool)` (or `reward_names(..., columns=True)`) resolves every
name the data will use, in this process and in a worker process, and checks each function's signature against
the columns its rows have; it raises a one-line `ValueError` naming the first that fails and why (module not
importable, no such function, unknown name, a parameter no row provides, no positional parameter) — so a typo
stops the run at start-up instead of scoring every response 0. (`check_rewards(reward_names(...), pool)`, names
without columns, checks signatures against the built-in rows' prompt, answer and task.)

Names are either keys of `REWARD_FNS` or an import path. "builtin" (the built-in tasks' own scorers) is
itself an import path, `jaxrl.data.tasks:builtin_reward`, resolved like a user's: `jaxrl.data` sits above
this package (its opt-in code task is scored by `code.code_reward`), so nothing here imports it.
Workers are separate processes: they get this process's `sys.path` (see `jaxrl.rewards.pool`), but
registering into `REWARD_FNS` at run time in the parent would *not* reach them, so there is deliberately
no `register()`; `rewards.registry` is the table users extend.
"""

from __future__ import annotations

import difflib
import importlib
from typing import Callable, Iterable, Mapping

from .calling import NOT_ROW_VALUES, RewardItem, call_plan, signature_problem
from .code import code_reward
from .math import math_reward

RewardFn = Callable[[str, str, str], float]
_MAX_LINE = 400


def math_fn(response: str, answer: str, task: str) -> float:
    """Math verifier (`jaxrl.rewards.math.math_reward`); `task` is unused."""
    return math_reward(response, answer)


def code_fn(response: str, answer: str, task: str, *, timeouts=None, limits=None, details: bool = False):
    """Code verifier (`jaxrl.rewards.code.code_reward`): the response's program run on the test cases in
    `answer`, in the sandbox. From the reward scheduler, per item: `timeouts` per test case, sandbox `limits`,
    `details=True` to return `(score, info)` with each case's run time and verdict. (Keywords, not `**extra`:
    a `**` parameter would receive every column of the row.)"""
    return code_reward(response, answer, task, timeouts=timeouts, limits=limits, details=details)


# a function, or the import path of one ("builtin": the built-in tasks' scorers, `jaxrl.data.tasks.score`)
REWARD_FNS: dict[str, RewardFn | str] = {"math": math_fn, "builtin": "jaxrl.data.tasks:builtin_reward",
                                         "code": code_fn}


class RewardLookupError(KeyError):
    """A reward name that does not resolve; `str()` is the one-line cause (not KeyError's repr)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def one_line(text: str, limit: int = _MAX_LINE) -> str:
    """`text` with every run of whitespace (newlines included) collapsed to one space, cut at `limit`."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def reward_fn_for(task: str) -> str:
    """Reward-function name for a task: `"math"` for the math task, `"code"` for code tasks (the built-in
    one and user JSONL rows with `"task": "code"`), `"builtin"` for every other task."""
    return task if task in ("math", "code") else "builtin"


def reward_name(row: Mapping, fn: str | None = None, registry: Mapping[str, str] | None = None, *,
                default: Callable[[str], str] = reward_fn_for) -> str:
    """The name to submit for `row`: its `"reward"` field, else `fn` (`rewards.fn`), else
    `default(row["task"])`; a key of `registry` (`rewards.registry`) is replaced by its import path."""
    name = row.get("reward") or fn or default(row["task"])
    return registry.get(name, name) if registry else name


def reward_names(rows: Iterable[Mapping], fn: str | None = None, registry: Mapping[str, str] | None = None, *,
                 columns: bool = False) -> set[str] | dict[str, frozenset[str]]:
    """Every name `reward_name` gives over `rows`: what a dataset will submit (for `check_rewards`);
    `columns=True`: `reward_columns` instead, each name with the columns its rows have."""
    if columns:
        return reward_columns(rows, fn, registry)
    return {reward_name(row, fn, registry) for row in rows}


def reward_columns(rows: Iterable[Mapping], fn: str | None = None,
                   registry: Mapping[str, str] | None = None) -> dict[str, frozenset[str]]:
    """{name: the columns every row scored by it has} over `rows` (`reward_name`'s names): what `check_rewards`
    checks each function's signature against. The loader's `index` and the `reward` field are not columns."""
    out: dict[str, frozenset[str]] = {}
    for row in rows:
        name, keys = reward_name(row, fn, registry), frozenset(row).difference(NOT_ROW_VALUES)
        out[name] = out[name] & keys if name in out else keys
    return out


def reward_item(name: str, response: str, row: Mapping) -> RewardItem:
    """The pool item scoring `response` for data row `row` with reward `name` (`reward_name`'s): the answer and
    task, and as `extra` only the row values the function takes by name (`calling.call_plan`: its signature;
    an old-style `fn(response, answer, task)` gets none). A name that does not resolve here gets no extras (the
    pool reports it; start-up's `check_rewards` refuses such names in a real run)."""
    found = _lookup(name)
    if isinstance(found, str):     # unresolvable here (a simulator's stand-in pool, say): the item as before, no
        return RewardItem(name, response, row["answer"], row["task"])   # extras; a worker scores it as a crash
    kwargs = call_plan(found).kwargs(row)
    return RewardItem(name, response, row["answer"], row["task"], kwargs or None)


def _lookup(name: str) -> RewardFn | str:
    """The function for `name`, or one line saying why there is none (imports the module here)."""
    fn = REWARD_FNS.get(name)
    if callable(fn):
        return fn
    name = fn or name          # a registered import path ("builtin") resolves like any other
    if ":" not in name:
        return (f"unknown reward {name!r}; registered: {', '.join(sorted(REWARD_FNS))} "
                "(or a name in rewards.registry, or a 'package.module:function' import path)")
    module, _, attr = name.partition(":")
    if not module or not attr or ":" in attr:
        return f"reward {name!r}: not a 'package.module:function' import path"
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # an import runs arbitrary code: anything it raises is the user's cause
        missing = getattr(e, "name", None) if isinstance(e, ModuleNotFoundError) else None
        hint = ("; the module must be importable in a fresh interpreter (PYTHONPATH, or the directory the "
                "run starts from)") if missing is not None and (module + ".").startswith(missing + ".") else ""
        return one_line(f"reward {name!r}: cannot import module {module!r} ({type(e).__name__}: {e}){hint}")
    if not hasattr(mod, attr):
        close = difflib.get_close_matches(attr, [a for a in dir(mod) if not a.startswith("_")
                                                 and callable(getattr(mod, a, None))], n=1)
        return (f"reward {name!r}: module {module!r} has no function {attr!r}"
                + (f" (did you mean {close[0]!r}?)" if close else ""))
    fn = getattr(mod, attr)
    if not callable(fn):
        return f"reward {name!r}: {module}.{attr} is a {type(fn).__name__}, not a function"
    return fn


def problem(name: str, columns: Iterable[str] | None = None) -> str | None:
    """Why `name` does not resolve in this process, or its function cannot be called for rows with `columns`
    (None: prompt, answer, task), as one line; None when it can."""
    found = _lookup(name)
    if isinstance(found, str):
        return found
    why = signature_problem(found, columns)
    return None if why is None else one_line(f"reward {name!r}: {why}")


def resolve(name: str) -> RewardFn:
    """The function for a registered name or a `"module:function"` import path;
    `RewardLookupError` (a KeyError) with the one-line cause otherwise."""
    found = _lookup(name)
    if isinstance(found, str):
        raise RewardLookupError(found)
    return found


def check_rewards(names: Iterable[str] | Mapping[str, Iterable[str]], pool) -> None:
    """Resolve every reward name and check its function's signature, in this process and in a worker of `pool`
    (`RewardPool.check`), before anything compiles; `ValueError` with one line naming the first failing name and
    the cause. `names`: a mapping {name: the columns its rows have} (`reward_columns`), or names alone (checked
    against the built-in rows' prompt, answer, task)."""
    columns = {n: (None if c is None else tuple(sorted(c))) for n, c in
               (names.items() if isinstance(names, Mapping) else dict.fromkeys(names).items())}
    names = sorted(columns)
    here = {n: p for n in names if (p := problem(n, columns[n])) is not None}
    where = ""
    if not here and names:
        here, where = pool.check(columns), " [in a reward worker process; it resolves in the training process]"
    if not here:
        return
    first, *others = sorted(here)
    also = f" (also failing: {', '.join(others)})" if others else ""
    raise ValueError(one_line(here[first] + where + also, 2 * _MAX_LINE))


def warmup() -> None:
    """Pay first-call costs (SymPy/LaTeX parser set-up, task imports) before a worker reports ready,
    so they never count against an item's timeout."""
    math_reward("\\boxed{\\frac{1}{2}}", "0.5")
    try:
        importlib.import_module(REWARD_FNS["builtin"].partition(":")[0])   # the built-in tasks (jaxrl.data)
    except ImportError:  # "builtin" will then fail per item, scored as a crash
        pass
