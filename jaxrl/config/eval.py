"""Config of held-out evaluation: `eval` in training (`jaxrl.eval.periodic`) and `python -m jaxrl.eval`.

`EvalSampling` is what one evaluation does (samples per prompt, temperature, pass@k, how many completions it
logs); `EvalSection` adds where the held-out prompts come from and when a training run evaluates.
"""

from __future__ import annotations

import dataclasses

from .base import ConfigError, Section, check_float, check_int, check_str


@dataclasses.dataclass(frozen=True)
class EvalSampling(Section):
    """One evaluation: `samples` per prompt at `temperature` (0 = greedy), through the rollout engine.
    Metrics: `accuracy` (mean@n: the mean reward over every sample), `pass@k` for each k in `pass_k` (the
    unbiased estimator of Chen et al. 2021 with rewards > `pass_threshold` counted as correct), mean length.
    `log_completions`: the worst and the best this many completions go to samples.jsonl (0: none)."""

    samples: int = 1                     # samples per held-out prompt
    temperature: float = 0.0             # 0 = greedy
    pass_k: tuple[int, ...] = ()         # pass@k for these k (each <= samples); () = (samples,) when samples > 1
    pass_threshold: float = 0.5          # a sample counts as correct for pass@k when its reward is above this
    max_prompts: int | None = None       # evaluate the first N held-out prompts only (null: all)
    log_completions: int = 2             # worst and best N completions of each evaluation to samples.jsonl
    seed: int = 1234                     # sampling seed (folded with each prompt's index; unused when greedy)

    def __post_init__(self):
        check_int("samples", self.samples, minimum=1)
        check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ConfigError("temperature", f"must be >= 0 (0 = greedy), got {self.temperature}")
        object.__setattr__(self, "pass_k", tuple(self.pass_k))
        for k in self.pass_k:
            check_int("pass_k", k, minimum=1)
            if k > self.samples:
                raise ConfigError("pass_k", f"pass@{k} needs at least {k} samples per prompt; eval.samples="
                                  f"{self.samples}")
        check_float("pass_threshold", self.pass_threshold)
        if self.max_prompts is not None:
            check_int("max_prompts", self.max_prompts, minimum=1)
        check_int("log_completions", self.log_completions, minimum=0)
        check_int("seed", self.seed, minimum=0)

    @property
    def ks(self) -> tuple[int, ...]:
        """The k of every pass@k reported."""
        return self.pass_k or ((self.samples,) if self.samples > 1 else ())


@dataclasses.dataclass(frozen=True)
class EvalSection(EvalSampling):
    """Held-out evaluation during training, off unless `data` or `split` is set. `data`: a .jsonl/.parquet
    file with the columns of `data.source` (its `data.prompt_key`/`answer_key`); `split`: hold out this many
    distinct prompts of `data.source` instead (removed from training). It runs before RL step 0
    (`at_start`), every `every` steps, and after the last step (`at_end`), on the weights the rollout engine
    holds, with the training rewards (`rewards.*`) and `rollout.max_new_tokens`."""

    data: str | None = None              # held-out prompts file (same columns as data.source)
    split: int = 0                       # or: hold out this many distinct prompts of data.source
    every: int | None = None             # also every N RL steps (null: only at the start and the end)
    at_start: bool = True                # before RL step 0
    at_end: bool = True                  # after the last RL step

    def __post_init__(self):
        super().__post_init__()
        check_str("data", self.data, allow_none=True)
        check_int("split", self.split, minimum=0)
        if self.every is not None:
            check_int("every", self.every, minimum=1)
        if self.data is not None and self.split:
            raise ConfigError("split", f"eval.data={self.data!r} is the held-out set already: set one of eval.data "
                              "and eval.split, not both")

    @property
    def enabled(self) -> bool:
        return self.data is not None or self.split > 0

    def due(self, step: int, steps: int) -> bool:
        """Whether a run of `steps` RL steps evaluates once `step` updates are done (before step `step`)."""
        if not self.enabled:
            return False
        if step == 0 and self.at_start:
            return True
        if step == steps and self.at_end:
            return True
        return self.every is not None and 0 < step < steps and step % self.every == 0
