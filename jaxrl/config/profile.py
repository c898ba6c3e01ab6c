"""`python -m jaxrl.rollout.profile`: PAT's offline profiler (`jaxrl.rollout.profile`)."""

from __future__ import annotations

import dataclasses

from .base import ConfigError, Section, check_int, check_str
from .generate import EngineSection
from .sections import ModelSection


def _default_engine() -> EngineSection:
    return EngineSection(tp=2, instances=4, max_batch=16, max_seq_len=1024)


@dataclasses.dataclass(frozen=True)
class ProfileConfig(Section):
    """Profile decode and prefill latency of every candidate TP layout of the rollout pool
    (`engine.tp` x `engine.instances` devices; the page budget and shapes as in `engine`), plus the switch
    costs between layouts. The JSON is the input of `engine.adaptive_tp.profile`."""

    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    engine: EngineSection = dataclasses.field(default_factory=_default_engine)
    candidates: tuple[int, ...] = ()       # TP sizes to profile (empty = every one the pool and heads allow)
    batches: int = 10                      # batch sizes per layout, geometric over [1, max batch per instance]
    contexts: tuple[int, ...] = ()         # context lengths (empty = 16..512 dense, then doubling to max_seq_len)
    decode_steps: int = 60                 # decode steps timed per point, their median (the paper's 60; fewer on a CPU)
    grid: str = "paper"                    # paper: batches x contexts; shapes: the XLA decode path's padded shapes
    passes: int = 1                        # times the whole grid is measured (each point: the median of its passes)
    seed: int = 0                          # random prompt tokens
    out: str = "profile.json"              # the profile (a PNG of the latencies goes beside it)
    cache_dir: str = "~/.cache/jaxrl/profiles"   # profiles by key (model shape, device, dtype, pool, engine)
    force: bool = False                    # re-measure even when the cache has this key

    def __post_init__(self):
        check_int("batches", self.batches, minimum=1)
        check_int("decode_steps", self.decode_steps, minimum=1)
        check_int("passes", self.passes, minimum=1)
        if self.grid not in ("paper", "shapes"):
            raise ConfigError("grid", f"must be 'paper' or 'shapes', got {self.grid!r}")
        check_int("seed", self.seed, minimum=0)
        check_str("out", self.out)
        check_str("cache_dir", self.cache_dir)
        for name in ("candidates", "contexts"):
            for v in getattr(self, name):
                check_int(name, v, minimum=1)
        bad = [t for t in self.candidates if self.engine.num_devices % t]
        if bad:
            raise ConfigError("candidates", f"{bad} do not divide the pool's {self.engine.num_devices} devices "
                              "(engine.tp x engine.instances)")
