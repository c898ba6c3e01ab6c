"""What a node function gets besides the step's data (`StepData`): the run's components, typed, its own
node and the plan (ARCHITECTURE.md, "Components": a node reads components, never the trainer).

    TrainContext   the components a run is made of, built once by the trainer from the config:
                     update        jaxrl.train.context.UpdateContext: train mesh, loss, micro-batch shape, the
                                   update (its `policy`: params, opt_state, ref_params)
                     rollout       jaxrl.train.rollout_side.RolloutSide: prompts, instances, tail batching,
                                   skew placement, the planner, PAT (`take(step)` is the step's rollout)
                     rewards       the reward scheduler, and the guard against all-failed steps
                     databuffer    DistFlow's token repartition (trainer.repartition=tokens), else None
                     worker        StreamRL's train-pool thread (placement=disaggregated), else None
                     stream        RollPacker's stream trainer (trainer.stream.enabled), else None
                     gstream       StreamRL's gradient stream into the train pool, else None
                     components    the registered components the config turns on, by name
                                   (`jaxrl.train.components`: PPO's "critic", OPD's "teacher");
                                   `component(name)`, and `critic` (None without PPO)
    FlowContext    (train, node, plan) for one node's call
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from jaxrl.config.train import TrainConfig
from jaxrl.rewards import RewardScheduler
from jaxrl.train.context import Policy, UpdateContext
from jaxrl.train.critic import Critic
from jaxrl.train.grad_stream import GradientStream
from jaxrl.train.pipeline import TrainWorker
from jaxrl.train.rl import RewardFailureGuard
from jaxrl.train.rollout_side import RolloutSide
from jaxrl.train.stream import StreamTrainer

from .databuffer import SampleBuffer
from .graph import Node
from .planner import Plan


@dataclasses.dataclass(frozen=True)
class TrainContext:
    cfg: TrainConfig
    tokenizer: Any
    update: UpdateContext
    rollout: RolloutSide
    rewards: RewardScheduler
    reward_guard: RewardFailureGuard
    databuffer: SampleBuffer | None
    worker: TrainWorker | None
    stream: StreamTrainer | None
    gstream: GradientStream | None
    log: logging.Logger
    components: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def component(self, name: str):
        """The registered component `name` (`jaxrl.train.components`); an error naming the ones that are on."""
        if name not in self.components:
            raise RuntimeError(f"this run has no {name!r} component (on: {', '.join(sorted(self.components)) or 'none'}); "
                               "its config section turns it on")
        return self.components[name]

    @property
    def critic(self) -> Critic | None:
        """PPO's value model (the registered "critic" component, algo.advantage=gae), else None."""
        return self.components.get("critic")

    @property
    def policy(self) -> Policy:
        return self.update.policy


@dataclasses.dataclass
class FlowContext:
    """What a node function gets besides the data: the run's components, its own node and the plan."""

    train: TrainContext
    node: Node
    plan: Plan

    @property
    def streamed(self) -> bool:
        """True when this node is a streamed consumer of a pipelined stage (its items were handled while
        the producer ran)."""
        return self.plan.streamed(self.node.id)

    @property
    def rewards_streamed(self) -> bool:
        """Whether the plan scores rewards as the rollout yields responses (a streamed reward node)."""
        return any(n.role == "reward" and n.type == "compute" and self.plan.streamed(n.id) for n in self.plan.graph.nodes)

    def streams_to(self, role: str, type: str) -> bool:
        """Whether a node of (role, type) takes this (head) node's items as a stream in its pipelined stage:
        the producer then wires that consumer's per-item work into its own loop."""
        stage = self.plan.stage_of(self.node.id)
        return stage.head.id == self.node.id and any(n.role == role and n.type == type for n in stage.nodes[1:])
