"""DistFlow's DAG planner (§4.2): a checked graph -> one deterministic chain of stages.

Each node's depth is the length of the longest dependency path to it; nodes run in (depth, id) order, so
same-depth nodes, which the graph lets run in parallel, are serialised in a stable order that does not
depend on the file's node order (every process plans the same chain from the same graph, with no
coordinator). A `stream` edge u -> v fuses v into u's stage: v takes u's items as u yields them (a
pipelined stage: rollout -> reward scores each response as it finishes). A streamed consumer's other
deps must be finished before its producer's stage starts; otherwise the stream could not be fed and the
planner says so, naming both nodes.
"""

from __future__ import annotations

import dataclasses

from .graph import Graph, GraphError, Node


@dataclasses.dataclass(frozen=True)
class Stage:
    nodes: tuple[Node, ...]       # the head first, then its streamed consumers in chain order

    @property
    def pipelined(self) -> bool:
        return len(self.nodes) > 1

    @property
    def head(self) -> Node:
        return self.nodes[0]


@dataclasses.dataclass(frozen=True)
class Plan:
    graph: Graph
    stages: tuple[Stage, ...]

    @property
    def order(self) -> list[str]:
        return [n.id for s in self.stages for n in s.nodes]

    def streamed(self, node_id: str) -> bool:
        """Whether `node_id` runs inside a pipelined stage as a streamed consumer."""
        return any(n.id == node_id for s in self.stages for n in s.nodes[1:])

    def stage_of(self, node_id: str) -> Stage:
        return next(s for s in self.stages if any(n.id == node_id for n in s.nodes))

    def describe(self) -> str:
        """One line per stage: `1. rollout => reward (pipelined)`."""
        return "\n".join(f"{i}. {' => '.join(n.id for n in s.nodes)}" + (" (pipelined)" if s.pipelined else "")
                         for i, s in enumerate(self.stages, 1))


def depths(graph: Graph) -> dict[str, int]:
    deps = {n.id: n.deps for n in graph.nodes}
    out: dict[str, int] = {}

    def depth(u):
        if u not in out:
            out[u] = 1 + max((depth(d) for d in deps[u]), default=-1)
        return out[u]

    for n in graph.nodes:
        depth(n.id)
    return out


def plan(graph: Graph) -> Plan:
    """The chain of stages for a checked graph (`graph.check` has run: no cycles, no dangling deps)."""
    depth = depths(graph)
    order = sorted(graph.nodes, key=lambda n: (depth[n.id], n.id))
    consumers = {n.id: [] for n in graph.nodes}
    for n in order:
        for s in n.stream:
            consumers[s].append(n)
    placed: set[str] = set()
    stages = []
    for n in order:
        if n.id in placed:
            continue
        if n.stream:     # a streamed consumer is placed with its producer, which comes first in the order
            raise GraphError(f"{graph.source}: node {n.id!r} streams from {list(n.stream)} but cannot join "
                             "that stage (it streams from two stages)")
        members, frontier = [n], [n]
        while frontier:
            u = frontier.pop(0)
            for v in consumers[u.id]:
                if v in members:
                    continue
                members.append(v)
                frontier.append(v)
        ids = {m.id for m in members}
        for v in members[1:]:
            for d in v.deps:
                if d not in ids and d not in placed:
                    raise GraphError(f"{graph.source}: node {v.id!r} streams from {list(v.stream)} but also "
                                     f"depends on {d!r}, which would run after that stream starts; make {d!r} a "
                                     f"dependency of {n.id!r} or drop the stream edge")
                if d in ids and d not in v.stream:
                    raise GraphError(f"{graph.source}: node {v.id!r} depends on {d!r} inside the pipelined stage "
                                     f"of {n.id!r} without streaming from it; mark the edge `stream`")
        members = [members[0]] + sorted(members[1:], key=lambda m: (depth[m.id], m.id))
        placed |= ids
        stages.append(Stage(tuple(members)))
    return Plan(graph, tuple(stages))
