"""Config of an AdamW optimizer (`optim`, `warm_start.optim`, `critic.optim`; built by `jaxrl.train.optim`)."""

from __future__ import annotations

import dataclasses

from .base import ConfigError, Section, check_choice, check_float, check_int

SCHEDULES = ("cosine", "linear", "constant")


@dataclasses.dataclass(frozen=True)
class OptimSection(Section):
    """AdamW with linear warm-up then `schedule` decay to lr * min_lr_ratio, global-norm clipping."""

    lr: float = 1e-6                     # peak learning rate
    warmup_steps: int = 0                # linear warm-up updates
    schedule: str = "constant"           # after warm-up: cosine, linear or constant
    min_lr_ratio: float = 0.1            # final lr = lr * min_lr_ratio (cosine, linear)
    weight_decay: float = 0.0            # AdamW decoupled weight decay
    b1: float = 0.9                      # Adam first-moment decay
    b2: float = 0.999                    # Adam second-moment decay
    eps: float = 1e-8                    # Adam denominator epsilon
    clip_norm: float | None = 1.0        # None = no clipping

    def __post_init__(self):
        check_float("lr", self.lr)
        if self.lr < 0:           # 0 freezes the weights (rollouts and metrics only; the async check uses it)
            raise ConfigError("lr", f"must be >= 0, got {self.lr}")
        check_int("warmup_steps", self.warmup_steps, minimum=0)
        check_choice("schedule", self.schedule, SCHEDULES)
        for name in ("min_lr_ratio", "weight_decay", "b1", "b2", "eps"):
            check_float(name, getattr(self, name))
        if self.clip_norm is not None:
            check_float("clip_norm", self.clip_norm, above=0.0)
