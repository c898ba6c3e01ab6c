"""A run's flow: `algo.graph` loaded, resolved against the config, planned and bound to functions at
start-up (every error before any work), then run once per RL step on this process's data (DistFlow's DAG
worker, §5: every process runs the same chain; no coordinator).

    flow = Flow.build(cfg, streamed_update=...)
    data = StepData(step)
    flow.run(train, data)            # `TrainContext`; each stage in order; data.times[node] = (start, end)
    flow.rollout_end(data)           # when the first stage (the rollout and what streams from it) ended
"""

from __future__ import annotations

import dataclasses
import time

from . import nodes, opd, ppo  # noqa: F401  (their @register decorators fill the registry with the built-in nodes)
from .context import FlowContext, TrainContext
from .data import StepData
from .graph import Graph, GraphError, check, load_graph
from .planner import Plan, plan
from .registry import NodeFn, bind

DEFAULT_GRAPHS = {"grpo": "grpo", "dr_grpo": "grpo", "rloo": "rloo", "reinforce_pp": "reinforce_pp", "gae": "ppo", "opd": "opd"}


def graph_name(cfg) -> str:
    """`algo.graph`, with "default" meaning the built-in graph of `algo.advantage`."""
    g = cfg.algo.graph
    return DEFAULT_GRAPHS[cfg.algo.advantage] if g == "default" else g


@dataclasses.dataclass
class Flow:
    graph: Graph
    plan: Plan
    fns: dict[str, NodeFn]

    @classmethod
    def build(cls, cfg, *, streamed_update: bool = False) -> "Flow":
        """`streamed_update`: the config streams groups into the update (stream trainer, StreamRL's
        pipelining): every edge between the rollout and the update is marked `stream`."""
        graph = load_graph(graph_name(cfg)).resolve(cfg)
        if streamed_update:
            graph = graph.with_stream(_edges_between(graph, ("actor", "model_inference"), ("actor", "model_train")))
        check(graph)
        p = plan(graph)
        fns = bind(graph, {n.id for s in p.stages for n in s.nodes[1:]})
        flow = cls(graph, p, fns)
        flow._check_config(cfg)
        return flow

    def _check_config(self, cfg) -> None:
        """What the config needs of the graph: a reward node, streamed where rewards must arrive during the
        rollout (dynamic sampling), a reference node for kl_coef, advantages of `algo.advantage`."""
        src = self.graph.source
        for n in self.graph.nodes:
            est = n.options.get("estimator") if (n.role, n.type) == ("advantage", "compute") else None
            if est is not None and est != cfg.algo.advantage:
                raise GraphError(f"{src}: node {n.id!r} computes {est} advantages but algo.advantage="
                                 f"{cfg.algo.advantage}; set algo.advantage={est} (or use another graph)")
        rewards = [n for n in self.graph.nodes if (n.role, n.type) == ("reward", "compute")]
        if not rewards:
            raise GraphError(f"{src}: missing required node: role reward, type compute (the rewards)")
        tb = cfg.rollout.tail_batching
        if tb.enabled and tb.dynamic_sampling and not any(self.plan.streamed(n.id) for n in rewards):
            raise GraphError(f"{src}: rollout.tail_batching.dynamic_sampling needs each group's rewards as the "
                             "rollout yields them: mark the reward node's edge from the rollout `stream`")
        kl = [n for n in self.graph.nodes if (n.role, n.type) == ("reference", "model_inference")]
        if cfg.algo.kl_coef and not kl:
            raise GraphError(f"{src}: algo.kl_coef={cfg.algo.kl_coef} needs a reference node "
                             "(role reference, type model_inference)")
        critic = {n.type for n in self.graph.nodes if n.role == "critic"}
        if cfg.algo.advantage == "gae" and not {"model_inference", "model_train"} <= critic:
            raise GraphError(f"{src}: algo.advantage=gae needs a critic: nodes (role critic, type model_inference) "
                             "for its values and (role critic, type model_train) for its update; use algo.graph=ppo")
        teacher = [n for n in self.graph.nodes if n.role == "teacher"]
        if cfg.algo.advantage == "opd" and not teacher:
            raise GraphError(f"{src}: algo.advantage=opd needs a teacher node (role teacher, type model_inference) "
                             "and the opd_advantage node after it; use algo.graph=opd")
        if teacher and cfg.algo.advantage != "opd":
            raise GraphError(f"{src}: the teacher's node needs algo.advantage=opd (its log-probs are OPD's advantage)")
        if critic and cfg.algo.advantage != "gae":
            raise GraphError(f"{src}: the critic's nodes need algo.advantage=gae (GAE is what reads its values)")
        if cfg.algo.kl_in_reward:
            adv = [n for n in self.graph.nodes if (n.role, n.type) == ("advantage", "compute")]
            if not any(self._ancestors(a.id) & {n.id for n in kl} for a in adv):
                raise GraphError(f"{src}: algo.kl_in_reward needs a reference node the advantage node depends on "
                                 "(the built-in `fn: reward_kl`), so the KL is known before the advantages")

    def _ancestors(self, node_id: str) -> set[str]:
        by_id = {n.id: n for n in self.graph.nodes}
        seen, todo = set(), list(by_id[node_id].deps)
        while todo:
            d = todo.pop()
            if d not in seen:
                seen.add(d)
                todo.extend(by_id[d].deps)
        return seen

    def run(self, train: TrainContext, data: StepData) -> StepData:
        """Every stage in order: a pipelined stage's head runs (its streamed consumers' per-item work
        inside it), then each consumer finishes what is left, in chain order."""
        for st in self.plan.stages:
            for node in st.nodes:
                t0 = time.perf_counter()
                self.fns[node.id](FlowContext(train, node, self.plan), data, **node.options)
                data.times[node.id] = (t0, time.perf_counter())
        return data

    def rollout_end(self, data: StepData) -> float:
        """When the step's first stage's head (the rollout, with what streams from it) ended, by the runner's
        records (`time.perf_counter`)."""
        return data.times[self.plan.stages[0].head.id][1]


def _edges_between(graph: Graph, src: tuple[str, str], dst: tuple[str, str]) -> list[tuple[str, str]]:
    """Every edge on a path from the (role, type) `src` node to the `dst` node."""
    by_id = {n.id: n for n in graph.nodes}
    start = [n.id for n in graph.nodes if (n.role, n.type) == src]
    end = [n.id for n in graph.nodes if (n.role, n.type) == dst]
    users = {n.id: [m.id for m in graph.nodes if n.id in m.deps] for n in graph.nodes}

    def reach(roots, nxt):
        seen, todo = set(roots), list(roots)
        while todo:
            for v in nxt(todo.pop()):
                if v not in seen:
                    seen.add(v)
                    todo.append(v)
        return seen

    between = reach(start, lambda u: users[u]) & reach(end, lambda u: by_id[u].deps)
    return [(d, v) for v in sorted(between) for d in by_id[v].deps if d in between]
