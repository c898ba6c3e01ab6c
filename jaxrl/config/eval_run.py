"""Config of `python -m jaxrl.eval` (recipe: configs/eval.yaml): training's model, data, reward and engine
sections, the evaluation's sampling (`eval`), and where the results go."""

from __future__ import annotations

import dataclasses

from .base import ConfigError, Section, check_int, check_str
from .eval import EvalSampling
from .generate import EngineSection
from .sections import ModelSection
from .train import DataSection, RewardSection


@dataclasses.dataclass(frozen=True)
class EvalConfig(Section):
    """The prompts of `data.source` (a .jsonl/.parquet file, or "builtin" with `data.tasks`) sampled by the
    rollout engine and scored by `rewards.*`; `output` gets a JSON with the metrics and every sample."""

    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    engine: EngineSection = dataclasses.field(default_factory=EngineSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    rewards: RewardSection = dataclasses.field(default_factory=RewardSection)
    eval: EvalSampling = dataclasses.field(default_factory=EvalSampling)
    max_new_tokens: int = 64             # tokens per response at most (training's rollout.max_new_tokens)
    seed: int = 0                        # builtin data: the suite's seed (training's seed)
    output: str = "eval.json"            # the metrics and every sample (JSON)

    def __post_init__(self):
        check_int("max_new_tokens", self.max_new_tokens, minimum=1)
        check_int("seed", self.seed, minimum=0)
        check_str("output", self.output)
        longest = self.data.max_prompt_len + self.max_new_tokens
        if longest > self.engine.max_seq_len:
            raise ConfigError("engine.max_seq_len", f"data.max_prompt_len {self.data.max_prompt_len} + "
                              f"max_new_tokens {self.max_new_tokens} = {longest} tokens > engine.max_seq_len="
                              f"{self.engine.max_seq_len}")
