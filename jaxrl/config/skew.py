"""`rollout.skew`: StreamRL's output-length ranker and skew-aware scheduling (`jaxrl.rollout.ranker`,
`jaxrl.rollout.skew`, `jaxrl.train.skew_step`)."""

from __future__ import annotations

import dataclasses

from .base import ConfigError, Section, check_float, check_int, check_str


@dataclasses.dataclass(frozen=True)
class RankerSection(Section):
    """The length ranker: a tiny transformer over the prompt's tokens trained on (prompt, observed mean
    response length) pairs from the run's own rollouts, `train_steps` Adam steps every `refresh_every`
    RL steps; Kendall τ and recall of the true top 20% on held-out pairs are logged at each refresh.
    `pairs`: a JSONL warm-start file ({"tokens": [ids], "length": n} or {"prompt": text, "length": n}),
    refreshed on before the first step. The ranker (weights, Adam state, history) is checkpointed."""

    refresh_every: int = 4                 # RL steps between refreshes (k; a refresh of 50 steps takes ~4 s on this CPU)
    train_steps: int = 50                  # Adam steps per refresh
    batch: int = 64                        # pairs per Adam step
    lr: float = 3e-3
    d_model: int = 32                      # (bench_ranker: 32 reaches recall 0.955; 64 the same at 3-4x the time)
    layers: int = 2
    heads: int = 4
    buckets: int = 1024                    # token ids hashed into this many embedding rows
    history: int = 4096                    # pairs kept (oldest dropped)
    holdout: float = 0.2                   # fraction of pairs held out for τ / recall
    pairs: str | None = None               # warm-start JSONL file of pairs

    def __post_init__(self):
        for name in ("refresh_every", "train_steps", "batch", "d_model", "layers", "heads", "buckets", "history"):
            check_int(name, getattr(self, name), minimum=1)
        check_float("lr", self.lr, above=0.0)
        check_float("holdout", self.holdout, above=0.0)
        if self.holdout >= 1:
            raise ConfigError("holdout", f"must be in (0, 1), got {self.holdout}")
        if self.d_model % self.heads:
            raise ConfigError("heads", f"d_model={self.d_model} must divide into {self.heads} heads")
        check_str("pairs", self.pairs, allow_none=True)


@dataclasses.dataclass(frozen=True)
class SkewSection(Section):
    """StreamRL skew-aware scheduling (paper §5.3): the top `alpha` of a step's prompts by predicted length
    go to N_l dedicated instances and the rest to the others, N_l (and each class's batch) chosen by
    PTL(BS)·L·⌈M/BS⌉ with L = P50/P90 of recent lengths; inside an instance, longest-predicted first
    (`lpt`). PTL comes from a PAT latency `profile` (`python -m jaxrl.rollout.profile`), else
    PTL(BS) = ptl_base_s + ptl_per_seq_s·BS. Until the ranker's first refresh, prompts go to the engine's
    default router (metric skew/active = 0)."""

    enabled: bool = False
    alpha: float = 0.2                     # fraction of prompts treated as long-tail
    lpt: bool = True                       # longest-predicted-first admission inside an instance
    profile: str | None = None             # PAT latency profile JSON for PTL(BS)
    ptl_base_s: float = 0.01               # no profile: seconds per decode step at batch 0 ...
    ptl_per_seq_s: float = 0.001           # ... plus this per sequence in the batch
    ranker: RankerSection = dataclasses.field(default_factory=RankerSection)

    def __post_init__(self):
        check_float("alpha", self.alpha)
        if not 0 <= self.alpha <= 1:
            raise ConfigError("alpha", f"must be in [0, 1], got {self.alpha}")
        for name in ("ptl_base_s", "ptl_per_seq_s"):
            check_float(name, getattr(self, name))
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)}")
        check_str("profile", self.profile, allow_none=True)
        if self.ptl_base_s + self.ptl_per_seq_s <= 0:
            raise ConfigError("ptl_base_s", "PTL(BS) must be positive: set ptl_base_s or ptl_per_seq_s above 0")
