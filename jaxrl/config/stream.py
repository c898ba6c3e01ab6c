"""Config of RollPacker's stream trainer (`trainer.stream`; the component is `jaxrl.train.stream`).

    trainer:
      stream:
        enabled: true
        start: 0.2          # milestones: 20% .. 50% of the step's requests finished, every 5%
        stop: 0.5
        step: 0.05
        kv_fraction: 0.5    # the projected peak KV of the live requests must fit in this share of the pool
        projection: history # how a live request's final length is projected: history or max

`check_stream(stream, cfg)` refuses the combinations whose streamed update could not equal the
synchronous one (or that the stream trainer cannot run), naming the key at fault; `TrainConfig` calls
it next to its other cross-section checks, and `StreamTrainer` calls it again on construction.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from .base import ConfigError, Section, check_choice, check_float, check_int

if TYPE_CHECKING:
    from .train import TrainConfig

PROJECTIONS = ("history", "max")


@dataclasses.dataclass(frozen=True)
class StreamSection(Section):
    """RollPacker's stream trainer (paper §4.4, Algorithm 1): when `start` <= finished/requests <= `stop`
    and another `step` of the requests finished since the last check, project the peak KV of the live
    requests; if it fits in `kv_fraction` of the rollout pool and the remaining instances can hold the
    moved requests, half of the rollout devices (whole instances, TP groups intact) stop generating,
    their live requests move to the other instances (KV recomputed), and completed groups' gradients
    are computed on them while the rollout goes on. One update at the end, equal to the synchronous one.

    `projection`: "max" = every live request grows to its max_new_tokens (a bound: never wrong on memory);
    "history" = the paper's: a live request that has generated g tokens ends at the `quantile` of the
    recorded response lengths longer than g (capped at its max_new_tokens; no such length -> the max).
    `history`: how many recent response lengths are kept (across steps)."""

    enabled: bool = False                # compute gradients on rollout devices freed mid-rollout
    start: float = 0.2                   # first milestone (fraction of the step's requests finished)
    stop: float = 0.5                    # last milestone
    step: float = 0.05                   # milestone spacing (Algorithm 1's ΔR / |R|)
    kv_fraction: float = 0.5             # projected peak KV pages <= kv_fraction x the whole pool's pages
    projection: str = "history"          # history (the paper's) or max (every request to its max length)
    quantile: float = 0.9                # history: quantile of the longer recorded lengths
    history: int = 4096                  # history: recent response lengths kept

    def __post_init__(self):
        if not isinstance(self.enabled, bool):
            raise ConfigError("enabled", f"expected a bool, got {type(self.enabled).__name__} {self.enabled!r}")
        for name in ("start", "stop", "step", "kv_fraction", "quantile"):
            check_float(name, getattr(self, name), above=0.0)
            if getattr(self, name) > 1:
                raise ConfigError(name, f"must be in (0, 1], got {getattr(self, name)}")
        if self.start > self.stop:
            raise ConfigError("start", f"start={self.start} is after stop={self.stop}")
        check_choice("projection", self.projection, PROJECTIONS)
        check_int("history", self.history, minimum=1)


def check_stream(stream: StreamSection, cfg: TrainConfig) -> None:
    """Refuse, with the key at fault, what the stream trainer cannot make exact or cannot run (only when
    `stream.enabled`)."""
    if not stream.enabled:
        return
    why = "with trainer.stream.enabled=true"
    a, t, e = cfg.algo, cfg.trainer, cfg.engine
    if a.mini_batches > 1:
        raise ConfigError("algo.mini_batches", f"{a.mini_batches} {why}: gradients streamed during the rollout are "
                          "taken at the rollout's weights, so only one update per rollout batch is exact; set 1")
    if a.advantage == "reinforce_pp":
        raise ConfigError("algo.advantage", f"reinforce_pp {why}: its advantages are normalised over the whole "
                          "batch, unknown until the rollout ends; use a group estimator (grpo, dr_grpo, rloo)")
    if t.micro_batch_tokens is None:
        raise ConfigError("trainer.micro_batch_tokens", f"null {why}: streamed gradients run over fixed-shape "
                          "micro-batches; set a token budget")
    if e.instances < 2 or e.instances % 2:
        raise ConfigError("engine.instances", f"{e.instances} {why}: half of the rollout devices are freed as "
                          "whole instances (TP groups intact), which needs an even number of instances")
