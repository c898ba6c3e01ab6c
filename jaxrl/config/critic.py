"""Config of PPO's value model (`critic`; the component is `jaxrl.train.critic`), used when
algo.advantage=gae (the `ppo` graph):

    algo:
      advantage: gae
      gamma: 1.0          # GAE discount
      lam: 0.95           # GAE lambda
    critic:
      value_clip: 0.2     # PPO's value clipping around the rollout-time values (null: plain squared error)
      optim: {lr: 1.0e-4} # the critic's own AdamW (same fields as `optim`)

`check_critic(cfg)` refuses the trainer modes the critic does not run in yet, naming the key at fault;
`TrainConfig` calls it beside its other cross-section checks.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from .base import ConfigError, Section, check_float
from .optim import OptimSection

if TYPE_CHECKING:
    from .train import TrainConfig


@dataclasses.dataclass(frozen=True)
class CriticSection(Section):
    """The value model: the policy's architecture with a scalar head (V(s) = w·h + b on the final-normed
    hidden state), its trunk initialised from the policy's weights when RL starts (after the warm start)
    and its head from zeros (every value starts at 0). Its own AdamW (`optim`), its own checkpoint entry.
    `value_clip`: ½·max((V − R)², (clip(V, V_old ± value_clip) − R)²); null = ½(V − R)²."""

    value_clip: float | None = 0.2       # PPO value clipping around the rollout-time values (null = off)
    optim: OptimSection = dataclasses.field(default_factory=lambda: OptimSection(lr=1e-4))   # the critic's own AdamW

    def __post_init__(self):
        if self.value_clip is not None:
            check_float("value_clip", self.value_clip, above=0.0)


def check_critic(cfg: "TrainConfig") -> None:
    """algo.advantage=gae needs a critic, whose values and GAE's whitening need the whole batch: the stream
    trainer (gradients per group during the rollout, before any values exist) and the bucketed fused step are
    refused. Disaggregated placement runs the critic on the train mesh and, since the advantages need the whole
    batch, trains after the rollout instead of streaming (`config.train.WHOLE_BATCH_ADVANTAGES`); one-step-async
    runs the critic's update before the policy's is handed to the train pool. algo.kl_in_reward's KL node
    runs on the update's fixed micro-batches before the advantages, at the sampling policy's weights: refused
    with the stream trainer and with one-step-async (the trainer is then one update ahead)."""
    t = cfg.trainer
    if cfg.algo.kl_in_reward:
        for bad, key in ((t.micro_batch_tokens is None, "trainer.micro_batch_tokens"),
                         (t.stream.enabled, "trainer.stream.enabled")):
            if bad:
                raise ConfigError(key, "algo.kl_in_reward: the KL node needs the update's fixed micro-batches "
                                  "before the advantages (set trainer.micro_batch_tokens, no stream trainer), or "
                                  "use kl_coef as a loss term")
        if t.max_staleness:
            raise ConfigError("trainer.max_staleness", "algo.kl_in_reward: the token rewards' KL is the sampling "
                              "policy's, which one-step-async no longer holds when it scores the batch (the "
                              "trainer is one update ahead); use kl_coef as a loss term")
    if cfg.algo.advantage != "gae":
        return
    refuse = [
        (t.micro_batch_tokens is None, "trainer.micro_batch_tokens",
         "the critic trains over fixed-shape micro-batches: set trainer.micro_batch_tokens (e.g. 2048)"),
    ]
    for bad, key, why in refuse:
        if bad:
            raise ConfigError(key, f"algo.advantage=gae (PPO with a critic): {why}")
