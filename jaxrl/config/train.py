"""Config of `python -m jaxrl.train` (default recipe: configs/quickstart.yaml)."""

from __future__ import annotations

import dataclasses

from jaxrl import algos
from models.forward import ATTENTION_IMPLS, REMAT_POLICIES

from .base import ConfigError, Section, check_choice, check_float, check_int, check_str
from .generate import EngineSection, SamplingSection
from .sections import LayoutSection, ModelSection

# Choices come from the `jaxrl.algos` registries (one list of names, not a copy). "gae" is left out of
# the advantages: it needs a critic (values per token), which this trainer does not have.
ADVANTAGES = tuple(name for name in algos.ADVANTAGE_ESTIMATORS if name != "gae")
AGGREGATIONS = tuple(algos.AGGREGATIONS)
KL_ESTIMATORS = tuple(algos.KL_ESTIMATORS)
SCHEDULES = ("cosine", "linear", "constant")


@dataclasses.dataclass(frozen=True)
class DataSection(Section):
    """`source`: "builtin" (the built-in task suite) or a local .jsonl / .parquet path with prompt/answer columns."""

    source: str = "builtin"
    tasks: tuple[str, ...] = ()          # builtin: which tasks (empty = all)
    num_examples: int = 20000            # builtin: suite size
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    tokenizer: str = "char"              # "char", or a dir with tokenizer.json ("model" = model.hf_path)
    chat: bool = True
    max_prompt_len: int = 64             # longer prompts are skipped and counted
    shuffle: bool = True

    def __post_init__(self):
        check_str("source", self.source)
        check_int("num_examples", self.num_examples, minimum=1)
        check_int("max_prompt_len", self.max_prompt_len, minimum=1)


@dataclasses.dataclass(frozen=True)
class AlgoSection(Section):
    """RL objective. GRPO defaults; DAPO = clip_high 0.28 + agg token-mean; Dr. GRPO = dr_grpo + seq-mean-token-sum-norm."""

    advantage: str = "grpo"
    group_size: int = 8                  # samples per prompt
    prompts_per_step: int = 16           # global, over all processes
    mini_batches: int = 1                # optimizer updates per rollout batch (>1 makes it off-policy)
    micro_batches: int = 1               # gradient accumulation inside one update
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None       # None = off; else c > 1
    agg: str = "token-mean"
    kl_coef: float = 0.0                 # KL to the reference policy (0 = no reference forward)
    kl_estimator: str = "k3"
    kl_in_reward: bool = False           # penalty in the reward (reinforce_pp) instead of the loss
    entropy_coef: float = 0.0
    gamma: float = 1.0

    def __post_init__(self):
        check_choice("advantage", self.advantage, ADVANTAGES)
        check_choice("agg", self.agg, AGGREGATIONS)
        check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        for name in ("group_size", "prompts_per_step", "mini_batches", "micro_batches"):
            check_int(name, getattr(self, name), minimum=1)
        for name in ("clip_low", "clip_high", "kl_coef", "entropy_coef", "gamma"):
            check_float(name, getattr(self, name))
        if self.dual_clip is not None:
            check_float("dual_clip", self.dual_clip, above=1.0)
        if self.kl_in_reward:
            raise ConfigError("kl_in_reward", "the KL reward penalty is not wired into the trainer yet (jaxrl.algos "
                              "supports it: outcome_token_rewards/reinforce_pp take kl=); use kl_coef as a loss term")
        if self.group_size < 2 and self.advantage in ("grpo", "dr_grpo", "rloo"):
            raise ConfigError("group_size", f"{self.advantage} needs group_size >= 2")

    def build(self, *, temperature: float, trainer: "TrainerSection", kind: str = "rl"):
        """The static `jaxrl.train.step.LossSpec` of this objective (`kind="sft"`: the warm start's NLL)."""
        from jaxrl.train.step import LossSpec

        if kind == "sft":
            return LossSpec(kind="sft", remat=trainer.remat, attention_impl=trainer.attention_impl)
        return LossSpec(clip_low=self.clip_low, clip_high=self.clip_high, dual_clip=self.dual_clip,
                        kl_coef=self.kl_coef, kl_estimator=self.kl_estimator, entropy_coef=self.entropy_coef,
                        temperature=temperature, remat=trainer.remat, attention_impl=trainer.attention_impl)


@dataclasses.dataclass(frozen=True)
class OptimSection(Section):
    """AdamW with linear warm-up then `schedule` decay to lr * min_lr_ratio, global-norm clipping."""

    lr: float = 1e-6
    warmup_steps: int = 0
    schedule: str = "constant"
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    clip_norm: float | None = 1.0        # None = no clipping

    def __post_init__(self):
        check_float("lr", self.lr, above=0.0)
        check_int("warmup_steps", self.warmup_steps, minimum=0)
        check_choice("schedule", self.schedule, SCHEDULES)
        for name in ("min_lr_ratio", "weight_decay", "b1", "b2", "eps"):
            check_float(name, getattr(self, name))
        if self.clip_norm is not None:
            check_float("clip_norm", self.clip_norm, above=0.0)

    def build(self, total_steps: int):
        """(optax transformation, learning-rate schedule) for `total_steps` updates (`jaxrl.train.optim`)."""
        from jaxrl.train.optim import make_optimizer

        return make_optimizer(self, total_steps)


@dataclasses.dataclass(frozen=True)
class TrainerSection(Section):
    """Train-forward options (the gradient step; log-prob passes use `attention_impl` only).

    `remat`: "none" saves every residual (fastest, most memory), "layer" saves each layer's input and
    recomputes the layer in the backward, "dots" saves the projection matmuls only (`models.forward`).
    `attention_impl`: "xla" or "pallas" (`kernels.attention`; interpret mode on the CPU, slow)."""

    remat: str = "none"
    attention_impl: str = "xla"

    def __post_init__(self):
        check_choice("remat", self.remat, REMAT_POLICIES)
        check_choice("attention_impl", self.attention_impl, ATTENTION_IMPLS)


@dataclasses.dataclass(frozen=True)
class WarmStartSection(Section):
    """Supervised warm start on the built-in tasks' demonstrations (steps 0 = skip); `batch_size` is global."""

    steps: int = 0
    batch_size: int = 32
    optim: OptimSection = dataclasses.field(default_factory=lambda: OptimSection(lr=3e-3, warmup_steps=20,
                                                                                  schedule="cosine"))

    def __post_init__(self):
        check_int("steps", self.steps, minimum=0)
        check_int("batch_size", self.batch_size, minimum=1)


@dataclasses.dataclass(frozen=True)
class RewardSection(Section):
    num_workers: int = 2                 # 0 = score in-process (no timeouts; debugging)
    timeout_s: float = 5.0

    def __post_init__(self):
        check_int("num_workers", self.num_workers, minimum=0)
        check_float("timeout_s", self.timeout_s, above=0.0)

    def build(self):
        """The `jaxrl.rewards.pool.RewardPool` (worker processes with hard per-item timeouts)."""
        from jaxrl.rewards.pool import RewardPool

        return RewardPool(num_workers=self.num_workers, timeout_s=self.timeout_s)


@dataclasses.dataclass(frozen=True)
class DistributedSection(Section):
    """jax.distributed: a null value falls back to JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
    JAX_PROCESS_ID in the environment; none of them set = single process."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    initialization_timeout: int = 120

    def __post_init__(self):
        check_str("coordinator", self.coordinator, allow_none=True)
        if self.num_processes is not None:
            check_int("num_processes", self.num_processes, minimum=1)
        if self.process_id is not None:
            check_int("process_id", self.process_id, minimum=0)
        check_int("initialization_timeout", self.initialization_timeout, minimum=1)


@dataclasses.dataclass(frozen=True)
class TrainConfig(Section):
    """Training layout (`train_layout`, over all devices of all processes) and rollout shape (`engine`:
    instances x tp on each process's local devices) are colocated on the same devices."""

    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    train_layout: LayoutSection = dataclasses.field(default_factory=LayoutSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    rollout: SamplingSection = dataclasses.field(default_factory=SamplingSection)
    engine: EngineSection = dataclasses.field(default_factory=EngineSection)
    algo: AlgoSection = dataclasses.field(default_factory=AlgoSection)
    optim: OptimSection = dataclasses.field(default_factory=OptimSection)
    trainer: TrainerSection = dataclasses.field(default_factory=TrainerSection)
    warm_start: WarmStartSection = dataclasses.field(default_factory=WarmStartSection)
    rewards: RewardSection = dataclasses.field(default_factory=RewardSection)
    distributed: DistributedSection = dataclasses.field(default_factory=DistributedSection)
    steps: int = 100
    seed: int = 0
    run_dir: str = "runs/quickstart"
    save_every: int | None = 10          # None = only at the end
    keep_checkpoints: int = 3
    export_hf: bool = True
    pack_len: int | None = None          # None = max_prompt_len + max_new_tokens (rounded up to 32)
    profile_steps: tuple[int, int] | None = None   # [start, stop]: jax.profiler trace of RL steps start..stop-1

    def __post_init__(self):
        check_int("steps", self.steps, minimum=0)
        check_int("seed", self.seed, minimum=0)
        check_str("run_dir", self.run_dir)
        if self.save_every is not None:
            check_int("save_every", self.save_every, minimum=1)
        check_int("keep_checkpoints", self.keep_checkpoints, minimum=1)
        if self.pack_len is not None:
            check_int("pack_len", self.pack_len, minimum=1)
        if self.profile_steps is not None:
            ps = self.profile_steps
            if (len(ps) != 2 or any(not isinstance(x, int) or isinstance(x, bool) for x in ps)
                    or not 0 <= ps[0] < ps[1]):
                raise ConfigError("profile_steps", f"expected [start, stop] integers with 0 <= start < stop "
                                  f"(--profile-steps 3:5), got {list(ps)!r}")
        if self.rollout.n != 1:
            raise ConfigError("rollout.n", "set algo.group_size instead (samples per prompt)")
