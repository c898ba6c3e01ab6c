"""The registry mechanism behind ADVANTAGE_ESTIMATORS and KL_ESTIMATORS (`lookup` serves AGGREGATIONS too,
whose entries are `Aggregation` records registered by `aggregation.register_aggregation`)."""

from __future__ import annotations

from typing import Callable


def registrar(table: dict[str, Callable], what: str):
    """A `register(name)` decorator adding functions to `table`; a repeated name is an error."""

    def register(name: str):
        def deco(fn):
            if name in table:
                raise ValueError(f"{what} {name!r} is already registered")
            table[name] = fn
            return fn
        return deco

    return register


def lookup(table: dict[str, Callable], name: str, what: str) -> Callable:
    """`table[name]`, or a ValueError listing the valid choices."""
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}; valid choices: {', '.join(sorted(table))}")
    return table[name]
