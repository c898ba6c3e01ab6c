"""`engine.adaptive_tp`: PAT's mid-generation TP switching (`jaxrl.rollout.tp_switch`)."""

from __future__ import annotations

import dataclasses

from .base import ConfigError, Section, check_choice, check_float, check_int, check_str

KV_CHOICES = ("auto", "migrate", "recompute")


@dataclasses.dataclass(frozen=True)
class AdaptiveTPSection(Section):
    """Every `check_every` decode steps, Algorithm 1 compares the predicted remaining decode time of the
    current layout with each candidate TP's (merged batch, max-length bound) plus the switch cost, from the
    profile `python -m jaxrl.rollout.profile` wrote, and relayouts the rollout pool mid-generation when a
    candidate wins. `kv`: how live sequences move (auto = the cheaper of migrate and recompute per switch).
    Between steps the pool returns to the step's starting layout (or the planner's).

    `warm`: the train warm-up compiles every candidate layout's step set, so a switch compiles nothing. It
    costs one compile of each layout's step set per instance (executables are per device set): with many
    instances on one CPU host that can exceed the process's memory-mapping limit (LLVM then aborts), so it
    is off by default; a layout is then compiled on its first switch, and until then the controller counts
    the profiled compile time in that switch's cost, unless `precompile` (default) compiled that layout's
    small decode buckets (rows up to `precompile_fraction` of its max batch) in a background thread since the
    controller first evaluated it (`jaxrl.rollout.precompile`)."""

    enabled: bool = False
    profile: str | None = None             # the profile JSON (python -m jaxrl.rollout.profile out=...)
    candidates: tuple[int, ...] = ()       # TP sizes to switch among (empty = every one in the profile)
    check_every: int = 16                  # decode steps between evaluations
    kv: str = "auto"                       # auto | migrate | recompute
    warm: bool = False                     # train warm-up compiles every candidate layout (no compile at a switch)
    precompile: bool = True                # compile unseen candidates' small decode buckets in the background
    precompile_fraction: float = 0.25      # "small": rows up to this fraction of the layout's max batch
    min_gain: float = 0.0                  # switch only when it saves this fraction of the remaining time (0: the paper's rule)

    def __post_init__(self):
        check_int("check_every", self.check_every, minimum=1)
        check_choice("kv", self.kv, KV_CHOICES)
        check_str("profile", self.profile, allow_none=True)
        check_float("min_gain", self.min_gain)
        if not 0 <= self.min_gain < 1:
            raise ConfigError("min_gain", f"{self.min_gain} must be in [0, 1)")
        if not 0 < self.precompile_fraction <= 1:
            raise ConfigError("precompile_fraction", f"{self.precompile_fraction} must be in (0, 1]")
        for t in self.candidates:
            check_int("candidates", t, minimum=1)
        if self.enabled and not self.profile:
            raise ConfigError("profile", "adaptive_tp.enabled needs a profile: run python -m jaxrl.rollout.profile "
                              "(same model and engine) and set engine.adaptive_tp.profile=PATH")
