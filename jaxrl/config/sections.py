"""Config sections shared by every entry point: the model, and the device layouts for training and rollout."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from models import config_from_hf
from models.peft_io import lora_config_from_peft
from models.config import LORA_TARGETS, PRESETS, LoraConfig, ModelConfig, preset
from sharding import Layout

from .base import Section, check_choice, check_int, check_str

DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class LoraSection(Section):
    """LoRA (`models.lora`): train low-rank adapters on the projections, the base weights frozen in their dtype.

    `rank` > 0 or an `adapter` turns it on. The reference policy is then the base model with the adapters off (no second copy
    of the weights), the optimizer state and the checkpoints hold the adapters alone, the weight sync moves
    the adapters alone, and the run ends with a merged HF checkpoint (`RUN/hf`) and a PEFT adapter
    (`RUN/adapter`). `adapter`: a PEFT adapter directory to start from (its rank, alpha and targets win).
    """

    rank: int = 0                          # adapter rank r; 0 = off (full-parameter training)
    alpha: float = 16.0                    # scale alpha / r on the adapter path
    dropout: float = 0.0                   # adapter input dropout; only 0 (RL scores with the sampling policy)
    targets: tuple[str, ...] = tuple(LORA_TARGETS)   # PEFT module names: q_proj ... down_proj
    adapter: str | None = None             # a PEFT adapter directory to start from / generate with (its r, alpha win)

    def __post_init__(self):
        check_int("rank", self.rank, minimum=0)
        check_str("adapter", self.adapter, allow_none=True)
        # alpha, dropout and targets are checked also while off, so a typo never passes silently (an adapter
        # directory is read when the model is built)
        LoraConfig(rank=self.rank or 1, alpha=float(self.alpha), dropout=float(self.dropout),
                   targets=tuple(self.targets))

    def config(self) -> LoraConfig | None:
        """The `models.config.LoraConfig` (the `adapter`'s when given: `models.peft_io.lora_config_from_peft`),
        or None when off."""
        if self.adapter:
            return lora_config_from_peft(self.adapter)
        if not self.rank:
            return None
        return LoraConfig(rank=self.rank, alpha=float(self.alpha), dropout=float(self.dropout),
                          targets=tuple(self.targets))


@dataclasses.dataclass(frozen=True)
class ModelSection(Section):
    """Which model to run: a named preset (`models.config.PRESETS`) or a local HF checkpoint.

    `hf_path`, when set, wins over `preset` (the preset is still validated). Whether the directory
    exists is checked by `model_config()`, not here, so a saved config still loads on another machine.
    `dtype` is the parameter and activation dtype. `sliding_window` (W) windows every layer's attention
    to the W most recent keys (`ModelConfig.sliding_window`), overriding the model's own; null keeps the
    model's (a checkpoint's config.json may set one). It changes what the model computes: meant for
    models trained with it and for MetroRLHF's zero-reward shortcut (`trainer.backward=blockwise`).
    """

    preset: str = "tiny-qwen3"             # a models.config.PRESETS name (shapes when hf_path is null)
    hf_path: str | None = None             # local HF checkpoint directory (config.json, *.safetensors); wins over preset
    dtype: str = "float32"                 # parameter and activation dtype: float32, bfloat16 or float16
    sliding_window: int | None = None      # attention window W on every layer; null = the model's own
    lora: LoraSection = dataclasses.field(default_factory=LoraSection)   # low-rank adapters (rank > 0: on)

    def __post_init__(self):
        check_choice("preset", self.preset, sorted(PRESETS))
        check_str("hf_path", self.hf_path, allow_none=True)
        check_choice("dtype", self.dtype, DTYPES)
        if self.sliding_window is not None:
            check_int("sliding_window", self.sliding_window, minimum=1)

    def model_config(self) -> ModelConfig:
        """The ModelConfig: read from `hf_path`'s config.json when set, else the preset; `sliding_window`
        replaces the model's window when set; `lora` (rank > 0) adds the adapters."""
        if self.hf_path is None:
            cfg = preset(self.preset)
        else:
            cfg = config_from_hf(self.hf_path)
        if self.lora.rank or self.lora.adapter:
            cfg = dataclasses.replace(cfg, lora=self.lora.config())
        if self.sliding_window is None:
            return cfg
        if cfg.architecture == "llama":     # refused now rather than at the HF export that ends the run
            raise ValueError(f"model.sliding_window={self.sliding_window}: transformers' Llama has no sliding window "
                             "(its HF checkpoint could not be exported); use a qwen2/qwen3 model")
        return dataclasses.replace(cfg, sliding_window=self.sliding_window)

    def jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)


@dataclasses.dataclass(frozen=True)
class LayoutSection(Section):
    """A device layout: data-parallel × FSDP × tensor-parallel sizes (mirrors `sharding.Layout`)."""

    dp: int = 1                            # data-parallel replicas
    fsdp: int = 1                          # fully-sharded data parallel (params and optimizer state sharded)
    tp: int = 1                            # tensor parallel (heads and MLP sharded)

    def __post_init__(self):
        for name in ("dp", "fsdp", "tp"):
            check_int(name, getattr(self, name), minimum=1)

    @property
    def num_devices(self) -> int:
        return self.dp * self.fsdp * self.tp

    def build(self) -> Layout:
        return Layout(dp=self.dp, fsdp=self.fsdp, tp=self.tp)


@dataclasses.dataclass(frozen=True)
class MeshSection(Section):
    """How devices are used: the training layout, and rollout as `rollout_instances` TP groups.

    The defaults use one device. Training and rollout may share devices or use disjoint pools; which
    one is the entry point's decision, so no relation between the two device counts is enforced here.
    """

    train: LayoutSection = dataclasses.field(default_factory=LayoutSection)
    rollout_tp: int = 1                    # devices per rollout instance (tensor parallel)
    rollout_instances: int = 1             # rollout instances, each with its own KV pool

    def __post_init__(self):
        check_int("rollout_tp", self.rollout_tp, minimum=1)
        check_int("rollout_instances", self.rollout_instances, minimum=1)

    @property
    def rollout_devices(self) -> int:
        return self.rollout_tp * self.rollout_instances
