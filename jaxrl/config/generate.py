"""Config of `python -m jaxrl.generate` (recipe: configs/generate.yaml)."""

from __future__ import annotations

import dataclasses

from .base import Section, check_choice, check_float, check_int, check_str
from .sections import ModelSection


@dataclasses.dataclass(frozen=True)
class SamplingSection(Section):
    """Mirrors `jaxrl.rollout.SamplingParams` (temperature 0 = greedy; top_k 0 and top_p 1 = off)."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    n: int = 1
    seed: int = 0

    def __post_init__(self):
        check_int("max_new_tokens", self.max_new_tokens, minimum=1)
        check_float("temperature", self.temperature)
        if self.temperature < 0:
            from .base import ConfigError
            raise ConfigError("temperature", f"must be >= 0, got {self.temperature}")
        check_int("top_k", self.top_k, minimum=0)
        check_float("top_p", self.top_p, above=0.0)
        check_int("n", self.n, minimum=1)
        check_int("seed", self.seed, minimum=0)


@dataclasses.dataclass(frozen=True)
class EngineSection(Section):
    """Rollout engine shape: `instances` TP groups of `tp` devices, each with its own paged KV pool."""

    tp: int = 1
    instances: int = 1
    page_size: int = 16
    num_pages: int = 0            # 0 = enough for max_batch sequences of max_seq_len
    max_batch: int = 64
    max_seq_len: int = 1024
    prefix_sharing: bool = True
    attention_impl: str = "xla"   # "pallas" = the Pallas kernels (GPU; interpret mode on the CPU)
    prefill_chunk: int = 256      # prompt tokens per row per prefill call
    prefill_tokens: int = 8192    # prompt tokens per prefill call (admitted prompts prefill together)
    overlap: bool = True          # dispatch decode step n+1 before reading step n

    def __post_init__(self):
        check_choice("attention_impl", self.attention_impl, ("xla", "pallas"))
        for name in ("tp", "instances", "page_size", "max_batch", "max_seq_len", "prefill_chunk", "prefill_tokens"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("num_pages", self.num_pages, minimum=0)

    def service_kwargs(self) -> dict:
        """Keyword arguments of `jaxrl.rollout.RolloutService` for this section."""
        return dict(tp=self.tp, instances=self.instances, page_size=self.page_size, num_pages=self.num_pages or None,
                    max_batch=self.max_batch, max_seq_len=self.max_seq_len, prefix_sharing=self.prefix_sharing,
                    attention_impl=self.attention_impl, prefill_chunk=self.prefill_chunk,
                    prefill_tokens=self.prefill_tokens, overlap=self.overlap)


@dataclasses.dataclass(frozen=True)
class GenerateConfig(Section):
    """Prompts JSONL in, completions JSONL out.

    Input lines: {"prompt": "text"} (tokenised; chat template applied when `chat` is true) or
    {"prompt_ids": [ints]}. `tokenizer`: "char" (built-in), a directory with tokenizer.json, or
    null = the model's hf_path (else "char").
    """

    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    sampling: SamplingSection = dataclasses.field(default_factory=SamplingSection)
    engine: EngineSection = dataclasses.field(default_factory=EngineSection)
    input: str = "prompts.jsonl"
    output: str = "completions.jsonl"
    tokenizer: str | None = None
    chat: bool = False

    def __post_init__(self):
        check_str("input", self.input)
        check_str("output", self.output)
        check_str("tokenizer", self.tokenizer, allow_none=True)
