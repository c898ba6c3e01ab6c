"""Config of `python -m jaxrl.generate` (recipe: configs/generate.yaml)."""

from __future__ import annotations

import dataclasses

from .adaptive_tp import AdaptiveTPSection
from .base import ConfigError, Section, check_choice, check_float, check_int, check_str
from .sections import ModelSection


@dataclasses.dataclass(frozen=True)
class SamplingSection(Section):
    """Per-request sampling (`jaxrl.rollout.SamplingParams`): temperature 0 = greedy; top_k None and top_p 1
    = no truncation."""

    max_new_tokens: int = 64          # tokens generated per response (at most)
    temperature: float = 1.0          # 0 = greedy
    top_k: int | None = None          # keep the k most likely tokens (null = all)
    top_p: float = 1.0                # nucleus: the smallest set with this much probability
    n: int = 1                        # samples per prompt
    seed: int = 0                     # sampling seed (generate: folded with each prompt's index)

    def __post_init__(self):
        check_int("max_new_tokens", self.max_new_tokens, minimum=1)
        check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ConfigError("temperature", f"must be >= 0, got {self.temperature}")
        if self.top_k == 0 and not isinstance(self.top_k, bool):
            raise ConfigError("top_k", "0 no longer means 'off': use null for no top-k truncation, or k >= 1")
        if self.top_k is not None:
            check_int("top_k", self.top_k, minimum=1)
        check_float("top_p", self.top_p, above=0.0)
        if self.top_p > 1:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p}")
        check_int("n", self.n, minimum=1)
        check_int("seed", self.seed, minimum=0)


@dataclasses.dataclass(frozen=True)
class EngineSection(Section):
    """Rollout engine shape: `instances` TP groups of `tp` devices, each with its own paged KV pool.

    `max_seq_len` is the longest sequence (prompt + max_new_tokens) the engine accepts; a longer request
    is refused when it is submitted, naming both numbers. Pages per instance: `num_pages` when set; else
    a per-device budget for the instance's weights + KV, `kv_bytes_per_device` bytes or
    `kv_memory_fraction` of each device's memory (GPU/TPU; default 0.5), minus its weight shard; on a CPU
    with neither, enough for `max_batch` sequences of `max_seq_len`.
    """

    tp: int = 1                       # devices per instance (tensor parallel)
    instances: int = 1                # instances (data parallel), each with its own KV pool
    page_size: int = 16               # tokens per KV page
    num_pages: int | None = None      # explicit pool size (pages, scratch page included)
    kv_bytes_per_device: int | None = None   # KV + weight budget per device (bytes)
    kv_memory_fraction: float | None = None  # ... or this fraction of device memory (GPU/TPU)
    max_batch: int = 64               # sequences decoded together per instance
    max_seq_len: int = 1024           # longest prompt + max_new_tokens accepted
    prefix_sharing: bool = True       # the samples of one prompt share its KV pages
    attention_impl: str = "xla"   # "pallas" = the Pallas kernels (GPU; interpret mode on the CPU)
    prefill_chunk: int = 256      # prompt tokens per row per prefill call
    prefill_tokens: int = 8192    # prompt tokens per prefill call (admitted prompts prefill together)
    overlap: bool = True          # dispatch decode step n+1 before reading step n
    batch_buckets_per_octave: int = 2   # decode batch buckets per doubling (more: less padding, more compiles)
    page_buckets: int = 4         # decode/prefill page-table widths: max_pages / 2^i, i < this (>= 4 pages)
    adaptive_tp: AdaptiveTPSection = dataclasses.field(default_factory=AdaptiveTPSection)   # PAT

    def __post_init__(self):
        check_choice("attention_impl", self.attention_impl, ("xla", "pallas"))
        for name in ("tp", "instances", "page_size", "max_batch", "max_seq_len", "prefill_chunk", "prefill_tokens",
                     "batch_buckets_per_octave", "page_buckets"):
            check_int(name, getattr(self, name), minimum=1)
        if self.num_pages is not None:
            check_int("num_pages", self.num_pages, minimum=2)
        if self.kv_bytes_per_device is not None:
            check_int("kv_bytes_per_device", self.kv_bytes_per_device, minimum=1)
        if self.kv_memory_fraction is not None:
            check_float("kv_memory_fraction", self.kv_memory_fraction, above=0.0)
            if self.kv_memory_fraction > 1:
                raise ConfigError("kv_memory_fraction", f"must be in (0, 1], got {self.kv_memory_fraction}")
        if self.kv_bytes_per_device is not None and self.kv_memory_fraction is not None:
            raise ConfigError("kv_memory_fraction", "set either kv_bytes_per_device or kv_memory_fraction, not both")

    @property
    def num_devices(self) -> int:
        return self.tp * self.instances


@dataclasses.dataclass(frozen=True)
class GenerateConfig(Section):
    """Prompts JSONL in, completions JSONL out.

    Input lines: {"prompt": "text"} (tokenised; chat template applied when `chat` is true) or
    {"prompt_ids": [ints]}. `tokenizer`: "char" (built-in), a directory with tokenizer.json, or
    null = the model's hf_path (else "char"). Output lines: one per sample, in input order (prompt index,
    then sample); prompt i samples with seed `prompt_seed(sampling.seed, i)`.
    """

    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    sampling: SamplingSection = dataclasses.field(default_factory=SamplingSection)
    engine: EngineSection = dataclasses.field(default_factory=EngineSection)
    input: str = "prompts.jsonl"      # JSONL of {"prompt": text} or {"prompt_ids": [ints]}
    output: str = "completions.jsonl" # JSONL, one line per sample, in input order
    tokenizer: str | None = None      # null = the model's (hf_path), else "char"; or a dir with tokenizer.json
    chat: bool = False                # wrap each prompt in the tokenizer's chat template

    def __post_init__(self):
        check_str("input", self.input)
        check_str("output", self.output)
        check_str("tokenizer", self.tokenizer, allow_none=True)
        if self.sampling.max_new_tokens >= self.engine.max_seq_len:
            raise ConfigError("engine.max_seq_len", f"sampling.max_new_tokens {self.sampling.max_new_tokens} leaves "
                              f"no room for a prompt in engine.max_seq_len={self.engine.max_seq_len}")
