"""`engine.planner`: RollPacker's parallelism planner (`jaxrl.rollout.planner`)."""

from __future__ import annotations

import dataclasses

from .base import ConfigError, Section, check_float, check_int


@dataclasses.dataclass(frozen=True)
class PlannerSection(Section):
    """Per round type, the rollout TP from preemption counts: x2 when a step's preemptions exceed `rise` x
    the previous step's of that round type, /2 after `calm_steps` consecutive steps without preemption,
    among the powers of two that divide the rollout pool and the model's heads (at most `max_tp`). It
    starts at `engine.tp`; the layout changes ride on the per-step weight sync. Pages per instance must
    come from the memory budget (`engine.kv_bytes_per_device` / `kv_memory_fraction`), not `num_pages`,
    or a larger TP gains no KV room."""

    enabled: bool = False             # plan the rollout TP per step (off: engine.tp x engine.instances throughout)
    rise: float = 1.05                # a count above rise x the previous one (same round type) doubles TP
    calm_steps: int = 4               # this many steps without preemption (same round type) halve TP
    max_tp: int | None = None         # cap on the planned TP (null: the pool's device count)

    def __post_init__(self):
        if not isinstance(self.enabled, bool):
            raise ConfigError("enabled", f"expected a bool, got {type(self.enabled).__name__} {self.enabled!r}")
        check_float("rise", self.rise)
        if not self.rise >= 1.0:
            raise ConfigError("rise", f"must be >= 1 (the factor a preemption count must grow by), got {self.rise}")
        check_int("calm_steps", self.calm_steps, minimum=1)
        if self.max_tp is not None:
            check_int("max_tp", self.max_tp, minimum=1)
