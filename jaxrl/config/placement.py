"""`placement`, `trainer.max_staleness` and `stage_balance`: StreamRL's disaggregated generation and training
(`jaxrl.train.pipeline`, `jaxrl.train.balance`)."""

from __future__ import annotations

import dataclasses

from .base import ConfigError, Section, check_int

PLACEMENTS = ("colocated", "disaggregated")


@dataclasses.dataclass(frozen=True)
class StageBalanceSection(Section):
    """StreamRL §4.2 dynamic scale-up (placement=disaggregated): after each step, with δ = T_g − T_t (the
    measured generation and training seconds), one more generation instance is added when δ >= δ', the
    generation time it is predicted to save (T_g / (k + 1) with k instances: data-parallel instances split
    the prompts), and a spare device group is free. `max_instances` instances at most; the process asks
    for their devices at start (the spare ones stay idle until used)."""

    scale_up: bool = False                 # add a generation instance when delta >= delta'
    max_instances: int | None = None       # generation instances at most (null: engine.instances, no spares)
    min_steps: int = 1                     # steps between two scale-ups (let the measurement settle)

    def __post_init__(self):
        if self.max_instances is not None:
            check_int("max_instances", self.max_instances, minimum=1)
        check_int("min_steps", self.min_steps, minimum=1)
        if self.scale_up and self.max_instances is None:
            raise ConfigError("max_instances", "stage_balance.scale_up needs spare devices: set "
                              "stage_balance.max_instances above engine.instances")


def check_placement(cfg) -> None:
    """Refuse, naming the key, what disaggregated or one-step-async training cannot run."""
    t, e, sb = cfg.trainer, cfg.engine, cfg.stage_balance
    if cfg.placement not in PLACEMENTS:
        raise ConfigError("placement", f"{cfg.placement!r}; valid choices: {', '.join(PLACEMENTS)}")
    check_int("trainer.max_staleness", t.max_staleness, minimum=0)
    if t.swap_step is not None and not t.max_staleness:
        raise ConfigError("trainer.swap_step", "needs trainer.max_staleness >= 1: a synchronous step's update runs "
                          "after its rollout, with no rollout in flight to swap into")
    if sb.max_instances is not None and sb.max_instances < e.instances:
        raise ConfigError("stage_balance.max_instances", f"{sb.max_instances} < engine.instances={e.instances}")
    if cfg.placement == "colocated":
        if t.max_staleness:
            raise ConfigError("trainer.max_staleness", f"{t.max_staleness} needs placement=disaggregated: on shared "
                              "devices the next rollouts cannot run while this step trains")
        if sb.scale_up:
            raise ConfigError("stage_balance.scale_up", "needs placement=disaggregated (separate pools to balance)")
        return
    why = "with placement=disaggregated"
    if t.micro_batch_tokens is None:
        raise ConfigError("trainer.micro_batch_tokens", f"null {why}: gradients stream over fixed-shape "
                          "micro-batches; set a token budget")
