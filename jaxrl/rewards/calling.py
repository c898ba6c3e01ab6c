"""How a reward function is called: which values of its data row it receives, decided once from its signature.

    def score(response, answer, task): ...                    # today's form: three positional values, nothing else
    def score(response, answer, *, prompt, difficulty): ...   # the prompt and a column of the row, by name
    def score(response, answer, task, **row): ...             # the prompt and every other column
    def reward(completions, **kwargs) -> list[float]: ...     # TRL's batched form, called with one-element lists

The rules (`call_plan`: `inspect.signature`, once per function, never a trial call):

* The function's first positional parameters, up to three (`*args`: all three), get the response, the answer and
  the task, in that order, whatever they are called. A function with no positional parameter is refused.
* Every other parameter it names is filled by name from the row's values: `response`, `answer`, `task`,
  `prompt` and the row's other columns (`jaxrl.data.dataset` keeps a file's extra columns). One no row provides
  must have a default, else `check_rewards` refuses the function at start-up, naming it; one with a default gets
  the row's value where the row has one (TRL's rule: columns are passed by name).
* `**kwargs` receives every row value not already passed (for a three-positional function: the prompt and the
  other columns).
* TRL's form (first parameter `completions` or `prompts`) is called with keywords only, each a list of one:
  `completions=[response]`, `prompts=[prompt]`, `answer=[answer]`, ... (the named values; all of them with
  `**kwargs`), and returns a list of one score (None, TRL's "not applicable", is an error here). It gets text,
  not chat messages; TRL's `completion_ids` and `trainer_state` are not provided (a function requiring one is
  refused at start-up).

An item carries only the values its function takes (`RewardItem.extra`), so a large column crosses the pool's
pipe only to a function that asks for it. The loader's `index` and the row's `reward` (the function's own name)
are not row values. A function whose signature cannot be read (a C builtin) is called the old way, with three.
The scheduler's own keywords for the code reward (`timeouts`, `limits`, `details`) are merged into `extra` after
the row's, so both reach it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Iterable, Mapping, NamedTuple

SLOTS = ("response", "answer", "task")          # the values passed by position, in order
NOT_ROW_VALUES = ("index", "reward")            # the loader's row number; the row's reward-function name
BUILTIN_COLUMNS = ("prompt", "answer", "task")  # what every row has (the built-in tasks' rows: only these)
BATCHED_FIRST = ("completions", "prompts")      # TRL's reward signature starts with one of these
_P = inspect.Parameter


class RewardItem(NamedTuple):
    fn: str  # registry name or "module:function"
    response: str
    answer: str
    task: str
    extra: Mapping[str, Any] | None = None  # keyword arguments of this item's call


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """How one function is called (see the module docstring): `positional` slots passed by position, the
    parameters filled by name (`named`; `required`: those without a default), whether it takes `**kwargs`, the
    positional parameters' own names (`taken`: kept out of `**kwargs`), TRL's batched form, and `problem`: why
    it cannot be called with a row at all (None: it can)."""

    positional: int = 3
    named: tuple[str, ...] = ()
    required: tuple[str, ...] = ()
    var_keyword: bool = False
    taken: tuple[str, ...] = ()
    batched: bool = False
    problem: str | None = None

    def values(self, row: Mapping) -> dict:
        """The row's values under the names this function's parameters use: those passed by position left out;
        batched, `prompts` for the prompt (the response goes to the call itself, as `completions`)."""
        values = {k: v for k, v in row.items() if k not in NOT_ROW_VALUES}
        if self.batched:
            values.pop("completions", None)
            if "prompt" in values:
                values["prompts"] = values.pop("prompt")
            return values
        for slot in SLOTS[:self.positional]:
            values.pop(slot, None)
        return values

    def kwargs(self, row: Mapping) -> dict:
        """The keyword arguments this function gets for data row `row` (never the response: it goes by position,
        or as `completions`)."""
        values = self.values(row)
        if self.var_keyword:
            return {k: v for k, v in values.items() if k not in self.taken}
        return {k: values[k] for k in self.named if k in values}

    def missing(self, columns: Iterable[str]) -> str | None:
        """The first required parameter that rows with `columns` do not provide (None: there is none)."""
        given = set(self.values(dict.fromkeys(columns))) | ({"completions"} if self.batched else set())
        return next((p for p in self.required if p not in given), None)


def call_plan(fn) -> CallPlan:
    """`fn`'s `CallPlan`, from its signature (cached per function)."""
    try:
        return _cached_plan(fn)
    except TypeError:         # an unhashable callable: not cached
        return _plan(fn)


@functools.lru_cache(maxsize=None)
def _cached_plan(fn) -> CallPlan:
    return _plan(fn)


def _plan(fn) -> CallPlan:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):       # no readable signature (a C builtin): the old call
        return CallPlan()
    var_keyword = any(p.kind is _P.VAR_KEYWORD for p in params)
    by_name = [p for p in params if p.kind in (_P.POSITIONAL_OR_KEYWORD, _P.KEYWORD_ONLY)]
    if params and params[0].name in BATCHED_FIRST and params[0].kind is not _P.VAR_POSITIONAL:
        names = tuple(p.name for p in by_name)
        problem = None
        if any(p.kind is _P.POSITIONAL_ONLY for p in params):
            problem = "a TRL-style reward (first parameter completions/prompts) is called with keywords only"
        elif "completions" not in names and not var_keyword:
            problem = "a TRL-style reward (first parameter prompts) must take completions (or **kwargs)"
        return CallPlan(0, names, _required(by_name), var_keyword, (), True, problem)
    positional = [p for p in params if p.kind in (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)]
    n = 3 if any(p.kind is _P.VAR_POSITIONAL for p in params) else min(3, len(positional))
    rest = ([p for p in positional[n:] if p.kind is _P.POSITIONAL_OR_KEYWORD]
            + [p for p in params if p.kind is _P.KEYWORD_ONLY])
    stuck = [p.name for p in positional[n:] if p.kind is _P.POSITIONAL_ONLY and p.default is p.empty]
    problem = None
    if n == 0:
        problem = ("takes no positional parameter: a reward is called as fn(response, answer, task, ...) "
                   "(or TRL's fn(completions, **kwargs))")
    elif stuck:
        problem = (f"has a required positional-only parameter {stuck[0]!r} after the three passed by position "
                   "(response, answer, task)")
    return CallPlan(n, tuple(p.name for p in rest), _required(rest), var_keyword,
                    tuple(p.name for p in positional[:n]), False, problem)


def _required(params) -> tuple[str, ...]:
    return tuple(p.name for p in params if p.default is p.empty)


def signature_problem(fn, columns: Iterable[str] | None) -> str | None:
    """Why `fn` cannot be called for rows with `columns` (None: the built-in rows' prompt, answer, task), as
    one line naming the parameter; None when it can."""
    plan = call_plan(fn)
    where = f"{getattr(fn, '__name__', type(fn).__name__)}{_signature_text(fn)}"
    if plan.problem is not None:
        return f"{where} {plan.problem}"
    columns = BUILTIN_COLUMNS if columns is None else columns
    param = plan.missing(columns)
    if param is None:
        return None
    have = ", ".join(sorted(set(columns) - set(NOT_ROW_VALUES)))
    also = "a TRL-style reward gets completions and prompts, not completion_ids" if plan.batched else \
        "a reward also gets the response"
    return (f"{where} requires parameter {param!r}, which not every row provides (rows have: {have}; {also}); "
            "give it a default, or add the column to the data")


def _signature_text(fn) -> str:
    """`fn`'s parameters as it was written, without annotations (short enough for one line)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return "(...)"
    bare = [p.replace(annotation=p.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=bare, return_annotation=sig.empty))


def invoke(fn, it: RewardItem):
    """Call `fn` on item `it` as its plan says; returns what it returned (one score for TRL's form)."""
    plan = call_plan(fn)
    extra = it.extra or {}
    if not plan.batched:
        return fn(*(it.response, it.answer, it.task)[:plan.positional], **extra)
    out = fn(completions=[it.response], **{k: [v] for k, v in extra.items()})
    if isinstance(out, (str, bytes, Mapping)) or not hasattr(out, "__len__") or len(out) != 1:
        size = f" of length {len(out)}" if hasattr(out, "__len__") else ""
        raise TypeError(f"a TRL-style reward returns a list of one score per completion; called with one, it "
                        f"returned a {type(out).__name__}{size}")
    if out[0] is None:
        raise ValueError("the TRL-style reward returned [None] (not applicable) for the completion")
    return out[0]
