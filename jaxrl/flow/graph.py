"""The RL step as data (DistFlow §4.1): a YAML graph of nodes, each with an `id`, a `role`, a `type`, its
`deps` and options, loaded and checked before any work starts.

    name: grpo
    nodes:
      - {id: rollout,   role: actor,     type: model_inference}
      - {id: reward,    role: reward,    type: compute, deps: [rollout], stream: [rollout]}
      - {id: advantage, role: advantage, type: compute, deps: [reward]}
      - {id: reference, role: reference, type: model_inference, deps: [advantage], when: algo.kl_coef}
      - {id: update,    role: actor,     type: model_train, deps: [advantage, reference]}

* `role`: actor, critic, reference, reward, advantage, or any other name (a user role needs `fn`).
* `type`: model_inference, model_train or compute.
* `deps`: the nodes whose outputs this one reads; `stream`: the subset of `deps` whose items it takes as
  the producer yields them (the planner fuses such edges into one pipelined stage).
* `fn`: a registered node name or a `package.module:function` import path; without it the node runs the
  function registered for its (role, type) (`jaxrl.flow.registry`).
* `when`: a dotted config key; the node is kept when that value is truthy (the built-in graphs' reference
  node: `algo.kl_coef`). A dropped node's dependants inherit its deps.
* `options`: keyword arguments of the node's function.

Errors name the node and the key: cycles (with the cycle), unknown types, unknown roles without `fn`,
dangling deps, duplicate ids, a stream edge that is not a dependency, and a missing required node
(a graph needs an actor model_inference node, the rollout, and an actor model_train node, the update).
Built-in graphs live in `jaxrl/flow/graphs/NAME.yaml`; `load_graph(NAME | PATH)`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

TYPES = ("model_inference", "model_train", "compute")
ROLES = ("actor", "critic", "reference", "reward", "advantage", "teacher")     # built-in roles (others need `fn`)
REQUIRED = (("actor", "model_inference"), ("actor", "model_train"))
GRAPHS_DIR = Path(__file__).parent / "graphs"
_KEYS = ("id", "role", "type", "deps", "stream", "fn", "when", "options")


class GraphError(ValueError):
    """A graph that cannot run; the message names the file and the node."""


@dataclasses.dataclass(frozen=True)
class Node:
    id: str
    role: str
    type: str
    deps: tuple[str, ...] = ()
    stream: tuple[str, ...] = ()         # deps whose items this node takes as they are produced
    fn: str | None = None                # registered name or "package.module:function"
    when: str | None = None              # dotted config key: kept when truthy
    options: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Graph:
    name: str
    nodes: tuple[Node, ...]
    source: str = "<memory>"

    def node(self, node_id: str) -> Node:
        return {n.id: n for n in self.nodes}[node_id]

    def resolve(self, config) -> Graph:
        """The graph for one run: nodes whose `when` key is falsy in `config` are dropped and their
        dependants inherit their deps (a stream edge through a dropped node stays a stream edge only if
        both hops were). Unknown `when` keys are errors."""
        dropped = {n.id: n for n in self.nodes if n.when is not None and not _config_value(config, n.when, self, n)}
        if not dropped:
            return self

        def expand(deps, stream):
            out, streamed = [], []
            for d in deps:
                if d in dropped:
                    inner, inner_s = expand(dropped[d].deps, dropped[d].stream)
                    out += inner
                    streamed += [x for x in inner_s if d in stream]
                else:
                    out.append(d)
                    streamed += [d] if d in stream else []
            return out, streamed

        nodes = []
        for n in self.nodes:
            if n.id in dropped:
                continue
            deps, stream = expand(n.deps, n.stream)
            nodes.append(dataclasses.replace(n, deps=tuple(dict.fromkeys(deps)), stream=tuple(dict.fromkeys(stream))))
        return dataclasses.replace(self, nodes=tuple(nodes))

    def with_stream(self, edges: list[tuple[str, str]]) -> Graph:
        """The same graph with the (producer, consumer) edges marked `stream` (the trainer does this for the
        update's input when the config streams gradients: RollPacker's stream trainer, StreamRL's pipelining)."""
        by_id = {n.id: n for n in self.nodes}
        for u, v in edges:
            if v not in by_id or u not in by_id[v].deps:
                raise GraphError(f"{self.source}: cannot stream {u} -> {v}: {v!r} does not depend on {u!r}")
            by_id[v] = dataclasses.replace(by_id[v], stream=tuple(dict.fromkeys(by_id[v].stream + (u,))))
        return dataclasses.replace(self, nodes=tuple(by_id[n.id] for n in self.nodes))


def _config_value(config, key: str, graph: Graph, node: Node):
    obj = config
    for part in key.split("."):
        if not dataclasses.is_dataclass(obj) or part not in {f.name for f in dataclasses.fields(obj)}:
            raise GraphError(f"{graph.source}: node {node.id!r}: when={key!r} is not a config key")
        obj = getattr(obj, part)
    return obj


def builtin_graphs() -> list[str]:
    return sorted(p.stem for p in GRAPHS_DIR.glob("*.yaml"))


def load_graph(name_or_path: str) -> Graph:
    """A built-in graph by name (`builtin_graphs()`) or a YAML file, parsed and checked (`check`)."""
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = GRAPHS_DIR / f"{name_or_path}.yaml"
        if not path.exists():
            raise GraphError(f"algo.graph: {name_or_path!r} is neither a built-in graph "
                             f"({', '.join(builtin_graphs())}) nor a .yaml file")
    elif not path.exists():
        raise GraphError(f"algo.graph: {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise GraphError(f"{path}: not valid YAML: {e}") from None
    return parse_graph(raw, source=str(path))


def parse_graph(raw: Any, source: str = "<memory>") -> Graph:
    if not isinstance(raw, dict) or not isinstance(raw.get("nodes"), list) or not raw["nodes"]:
        raise GraphError(f"{source}: expected a mapping with a non-empty `nodes:` list")
    unknown = set(raw) - {"name", "nodes", "description"}
    if unknown:
        raise GraphError(f"{source}: unknown top-level key(s) {sorted(unknown)}; valid: name, nodes, description")
    nodes = []
    for i, item in enumerate(raw["nodes"]):
        where = f"{source}: nodes[{i}]"
        if not isinstance(item, dict):
            raise GraphError(f"{where}: expected a mapping, got {item!r}")
        if "id" in item:
            where = f"{source}: node {item['id']!r}"
        bad = set(item) - set(_KEYS)
        if bad:
            raise GraphError(f"{where}: unknown key(s) {sorted(bad)}; valid: {', '.join(_KEYS)}")
        for key in ("id", "role", "type"):
            if not isinstance(item.get(key), str) or not item[key]:
                raise GraphError(f"{where}: `{key}` must be a non-empty string, got {item.get(key)!r}")
        lists = {}
        for key in ("deps", "stream"):
            v = item.get(key, [])
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                raise GraphError(f"{where}: `{key}` must be a list of node ids, got {v!r}")
            lists[key] = tuple(v)
        for key in ("fn", "when"):
            if item.get(key) is not None and not isinstance(item[key], str):
                raise GraphError(f"{where}: `{key}` must be a string, got {item[key]!r}")
        options = item.get("options") or {}
        if not isinstance(options, dict):
            raise GraphError(f"{where}: `options` must be a mapping, got {options!r}")
        nodes.append(Node(item["id"], item["role"], item["type"], lists["deps"], lists["stream"], item.get("fn"),
                          item.get("when"), dict(options)))
    graph = Graph(str(raw.get("name") or Path(source).stem), tuple(nodes), source)
    check(graph)
    return graph


def check(graph: Graph) -> None:
    """Every structural error, before any work: duplicate ids, unknown types, unknown roles without `fn`,
    dangling deps, stream edges outside deps, cycles and the required (role, type) nodes."""
    src, seen = graph.source, set()
    for n in graph.nodes:
        if n.id in seen:
            raise GraphError(f"{src}: node {n.id!r} is defined twice")
        seen.add(n.id)
    for n in graph.nodes:
        if n.type not in TYPES:
            raise GraphError(f"{src}: node {n.id!r}: unknown type {n.type!r}; valid: {', '.join(TYPES)}")
        if n.role not in ROLES and n.fn is None:
            raise GraphError(f"{src}: node {n.id!r}: role {n.role!r} is not built in ({', '.join(ROLES)}); "
                             "a user-defined role needs `fn: package.module:function`")
        for d in n.deps:
            if d not in seen:
                raise GraphError(f"{src}: node {n.id!r} depends on {d!r}, which is not a node of the graph")
            if d == n.id:
                raise GraphError(f"{src}: node {n.id!r} depends on itself")
        for s in n.stream:
            if s not in n.deps:
                raise GraphError(f"{src}: node {n.id!r}: stream edge from {s!r} is not one of its deps {list(n.deps)}")
    cycle = _find_cycle(graph)
    if cycle:
        raise GraphError(f"{src}: cycle {' -> '.join(cycle)} (at node {cycle[0]!r})")
    have = {(n.role, n.type) for n in graph.nodes}
    for role, typ in REQUIRED:
        if (role, typ) not in have:
            what = "the rollout" if typ == "model_inference" else "the update"
            raise GraphError(f"{src}: missing required node: role {role}, type {typ} ({what})")


def _find_cycle(graph: Graph) -> list[str]:
    deps = {n.id: n.deps for n in graph.nodes}
    state: dict[str, int] = {}        # 1 visiting, 2 done
    stack: list[str] = []

    def visit(u):
        state[u] = 1
        stack.append(u)
        for d in deps[u]:
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[u] = 2
        return []

    for n in graph.nodes:
        if n.id not in state:
            found = visit(n.id)
            if found:
                return found
    return []
