"""DistFlow: the RL step as a graph of stages that every process plans identically and runs on its own data.

    graph.py       YAML graph (id, role, type, deps, stream, fn, when, options) and its checks
    planner.py     graph -> one deterministic chain of stages (stream edges fused into pipelined stages)
    registry.py    (role, type) -> node function; user nodes by "package.module:function"
    nodes.py       the built-in nodes (the trainer's stage functions)
    ppo.py         PPO's nodes: the critic's values and update, the reward's KL penalty
    data.py        StepData (one step's data on this process)
    context.py     TrainContext (the run's components, typed) and FlowContext (what a node gets)
    runner.py      Flow: load, resolve against the config, plan, bind, run
    databuffer.py  repartition between data-parallel layouts on the devices (contiguous, token-balanced)
"""

from .context import FlowContext, TrainContext
from .data import StepData
from .databuffer import Databuffer, SampleBuffer, padding, plan_contiguous, plan_tokens
from .graph import Graph, GraphError, Node, builtin_graphs, load_graph, parse_graph
from .planner import Plan, Stage, plan
from .registry import register
from .runner import Flow

__all__ = ["Databuffer", "Flow", "FlowContext", "Graph", "GraphError", "Node", "Plan", "SampleBuffer", "Stage",
           "StepData", "TrainContext", "builtin_graphs", "load_graph", "padding", "parse_graph", "plan", "plan_contiguous",
           "plan_tokens", "register"]
