"""(role, type) -> node function (DistFlow §5, Fig. 5), and user nodes by import path.

A node function is

    def fn(ctx: jaxrl.flow.FlowContext, data: jaxrl.flow.StepData, **options) -> None

It reads what its deps left in `data` and writes its own outputs there (the step's databuffer on this
process). `ctx.train` is the run's components (`TrainContext`: config, update and policy, rollout side,
rewards, ...);
`ctx.node` is the node; `ctx.streamed` tells a built-in node that it runs inside a pipelined stage (its
items were handled as the producer yielded them). A user node is named by `fn: package.module:function`
(importable from the run's directory or PYTHONPATH) and is checked when the plan is built: the import,
that it is callable, and that `fn(ctx, data, **options)` binds its signature, so a typo fails before any
work, naming the node.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Callable

from .graph import Graph, GraphError, Node

NodeFn = Callable[..., None]
_BY_ROLE_TYPE: dict[tuple[str, str], NodeFn] = {}
_BY_NAME: dict[str, NodeFn] = {}
_STREAMABLE: set[NodeFn] = set()


def register(role: str | None = None, type: str | None = None, *, name: str | None = None, stream: bool = False):
    """Decorator: the default function of (role, type) and/or a named built-in node (`fn: NAME`).
    `stream`: it can run as a streamed consumer in a pipelined stage."""
    def deco(fn):
        if role is not None:
            _BY_ROLE_TYPE[(role, type)] = fn
        _BY_NAME[name or fn.__name__] = fn
        if stream:
            _STREAMABLE.add(fn)
        return fn
    return deco


def import_node(path: str, where: str) -> NodeFn:
    mod_name, sep, attr = path.partition(":")
    if not sep or not mod_name or not attr:
        raise GraphError(f"{where}: fn {path!r} is not a registered node ({', '.join(sorted(_BY_NAME))}) "
                         "nor 'package.module:function'")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise GraphError(f"{where}: cannot import {mod_name!r} for fn {path!r}: {e}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise GraphError(f"{where}: module {mod_name!r} has no {attr!r} (fn {path!r})")
    if not callable(fn):
        raise GraphError(f"{where}: fn {path!r} is not callable")
    return fn


def resolve(node: Node, source: str = "<graph>") -> NodeFn:
    """The function a node runs: its `fn` (a registered name or an import path), else its (role, type)'s.
    Checks that `fn(ctx, data, **options)` binds. The built-in nodes are registered when `jaxrl.flow` is
    imported (`runner` imports `nodes` and `ppo`)."""
    where = f"{source}: node {node.id!r}"
    if node.fn is not None:
        fn = _BY_NAME.get(node.fn) or import_node(node.fn, where)
    else:
        fn = _BY_ROLE_TYPE.get((node.role, node.type))
        if fn is None:
            known = ", ".join(f"({r}, {t})" for r, t in sorted(_BY_ROLE_TYPE))
            raise GraphError(f"{where}: no function registered for (role {node.role}, type {node.type}); "
                             f"registered: {known}; or give the node `fn: package.module:function`")
    try:
        inspect.signature(fn).bind(None, None, **node.options)
    except TypeError as e:
        raise GraphError(f"{where}: {getattr(fn, '__qualname__', fn)} cannot be called as fn(ctx, data, "
                         f"**options) with options {sorted(node.options)}: {e}") from None
    except ValueError:           # builtins without a signature: trust them
        pass
    return fn


def bind(graph: Graph, streamed: set[str]) -> dict[str, NodeFn]:
    """Every node's function; a node in `streamed` (a consumer in a pipelined stage) must be streamable."""
    fns = {n.id: resolve(n, graph.source) for n in graph.nodes}
    for nid in streamed:
        if fns[nid] not in _STREAMABLE:
            raise GraphError(f"{graph.source}: node {nid!r} is a stream consumer, but its function "
                             f"{getattr(fns[nid], '__qualname__', fns[nid])} takes a whole batch; drop the "
                             "stream edge (it then runs after its producer)")
    return fns
