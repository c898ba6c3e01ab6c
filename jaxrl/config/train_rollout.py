"""Rollout sections that exist only in training (`python -m jaxrl.train`): RollPacker's tail batching
under `rollout.tail_batching` and its TP planner under `engine.planner`. `python -m jaxrl.generate` has
no rounds or steps, so its sections do not carry these keys (a key it would ignore is not accepted)."""

from __future__ import annotations

import dataclasses

from .base import ConfigError, Section, check_float, check_int, check_str
from .generate import EngineSection, SamplingSection
from .planner import PlannerSection
from .skew import SkewSection
from .turns import TurnsSection


@dataclasses.dataclass(frozen=True)
class TailBatchingSection(Section):
    """RollPacker tail batching (`jaxrl.rollout.tail_batching`): a short round launches ⌈eta_prompts·P0⌉
    prompts x ⌈eta_responses·R0⌉ responses (P0 = algo.prompts_per_step, R0 = algo.group_size), keeps the
    first R0 finished responses of the first P0 prompts to have them and aborts the rest; the prompts it
    drops wait in the long-prompt queue, and once it holds P0 of them the next step is a long round (P0
    queued prompts x R0, no speculation). The paper's setting: 1.25 for both.

    `dynamic_sampling` (DAPO, `jaxrl.train.rounds`): groups whose rewards are all equal are dropped (neither
    trained nor queued) and a short round draws up to `max_waves` speculative waves until P0 prompts with
    unequal rewards are kept.

    `carry_partial` (slime's partial rollouts, `jaxrl.rollout.partial_carry`): a deferred prompt keeps R0 of
    its responses as they stood (tokens, log-probs, each token's weights version) and the long round continues
    them instead of starting again; tokens older than trainer.max_staleness versions follow
    trainer.stale_samples. slime's own setting: eta_responses=1 (n responses per prompt), eta_prompts > 1."""

    enabled: bool = False                # speculative short rounds + long rounds from the long-prompt queue
    eta_prompts: float = 1.25            # short round: prompts launched / prompts kept (>= 1)
    eta_responses: float = 1.25          # short round: responses launched per prompt / kept (>= 1)
    dynamic_sampling: bool = False       # DAPO: drop all-equal reward groups, refill the short round
    max_waves: int = 4                   # dynamic sampling: speculative draws per short round at most
    carry_partial: bool = False          # slime's partial rollouts: deferred prompts keep their responses' tokens for the long round

    def __post_init__(self):
        check_float("eta_prompts", self.eta_prompts, above=0.0)
        check_float("eta_responses", self.eta_responses, above=0.0)
        check_int("max_waves", self.max_waves, minimum=1)
        if self.carry_partial and not self.enabled:
            raise ConfigError("carry_partial", "carries a short round's partial responses to the long round: set "
                              "rollout.tail_batching.enabled=true as well")
        if self.dynamic_sampling and not self.enabled:
            raise ConfigError("dynamic_sampling", "rides on tail batching's over-sampling race: set "
                              "rollout.tail_batching.enabled=true as well")
        for name in ("eta_prompts", "eta_responses"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1 (the speculation factor), got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class TrainSamplingSection(SamplingSection):
    """Sampling of the RL rollouts, plus `tail_batching` (RollPacker), `skew` (StreamRL) and multi-turn
    rollouts with an environment (`env`, `turns`)."""

    tail_batching: TailBatchingSection = dataclasses.field(default_factory=TailBatchingSection)
    skew: SkewSection = dataclasses.field(default_factory=SkewSection)
    env: str | None = None               # multi-turn: a built-in environment (tools, calculator) or "pkg.mod:Env"; null: single-turn
    turns: TurnsSection = dataclasses.field(default_factory=TurnsSection)

    def __post_init__(self):
        super().__post_init__()
        check_str("env", self.env, allow_none=True)


@dataclasses.dataclass(frozen=True)
class TrainEngineSection(EngineSection):
    """The rollout engine of training, plus `planner` (RollPacker's per-step TP planner)."""

    planner: PlannerSection = dataclasses.field(default_factory=PlannerSection)

    def __post_init__(self):
        super().__post_init__()
        if self.planner.enabled and self.num_pages is not None:
            raise ConfigError("planner.enabled", f"with engine.num_pages={self.num_pages} every layout gets the same "
                              "pages, so a larger TP relieves no memory pressure: set engine.kv_bytes_per_device "
                              "(or kv_memory_fraction) instead")
        if self.planner.enabled and self.kv_bytes_per_device is None and self.kv_memory_fraction is None:
            raise ConfigError("planner.enabled", "the planner trades TP for KV room, which needs a memory budget: set "
                              "engine.kv_bytes_per_device (CPU) or engine.kv_memory_fraction (GPU)")
