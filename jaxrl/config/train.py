"""Config of `python -m jaxrl.train` (default recipe: configs/quickstart.yaml)."""

from __future__ import annotations

import dataclasses

from jaxrl import algos
from models.forward import ATTENTION_IMPLS, REMAT_POLICIES

from .base import ConfigError, Section, check_choice, check_float, check_int, check_sections, check_str

BACKWARDS = ("full", "blockwise")              # trainer.backward (jaxrl.train.blockwise)
KV_SOURCES = ("recompute", "rollout")          # trainer.kv_source
STALE_RULES = ("drop", "correct")             # trainer.stale_samples (`jaxrl.rollout.partial_carry`)
SWAP_KV = ("keep", "recompute")                # trainer.swap_kv (`RolloutService.swap_weights`)
REPARTITIONS = ("none", "tokens")              # trainer.repartition (jaxrl.flow.databuffer)
from .rewards import AdaptiveTimeoutSection, SandboxSection
from .stream import StreamSection, check_stream
from .objective import check_carry, check_objective, check_objective_fields
from .placement import StageBalanceSection, check_placement
from .train_rollout import TrainEngineSection, TrainSamplingSection
from .sections import LayoutSection, ModelSection
from .optim import OptimSection  # (also imported from here: jaxrl.config.train.OptimSection)
from .critic import CriticSection, check_critic
from .declarations import check_declarations
from .eval import EvalSection
from .distill import OpdSection, TeacherSection, check_distill

# Choices come from the `jaxrl.algos` registries (one list of names, not a copy); "gae" is PPO with a
# critic (`critic` section, the `ppo` graph).
ADVANTAGES = tuple(algos.ADVANTAGE_ESTIMATORS)
KL_IN_REWARD = ("gae", "reinforce_pp")        # estimators whose token rewards carry the KL penalty
# estimators whose advantages need the whole batch (GAE's whitening over every token, REINFORCE++'s batch
# normalisation): an update cannot start per group before the rollout ends (streamed gradients)
WHOLE_BATCH_ADVANTAGES = ("gae", "reinforce_pp", "opd")    # (opd: the teacher scores the batch after the rollout)
AGGREGATIONS = tuple(algos.AGGREGATIONS)
KL_ESTIMATORS = tuple(algos.KL_ESTIMATORS)


@dataclasses.dataclass(frozen=True)
class DataSection(Section):
    """`source`: "builtin" (the built-in task suite) or a local .jsonl / .parquet path with prompt/answer columns."""

    source: str = "builtin"              # "builtin" tasks, or a .jsonl / .parquet file of prompt/answer rows
    tasks: tuple[str, ...] = ()          # builtin: which tasks (empty = all)
    num_examples: int = 20000            # builtin: suite size
    prompt_key: str = "prompt"           # column holding the prompt (DeepScaleR: problem)
    answer_key: str = "answer"           # column holding the reference answer
    tokenizer: str | None = None         # null = the model's own (model.hf_path's, else "char"); or a dir with tokenizer.json
    chat: bool = True                    # wrap each prompt in the tokenizer's chat template
    max_prompt_len: int = 64             # longer prompts are skipped and counted
    shuffle: bool = True                 # a new seeded permutation of the rows every epoch

    def __post_init__(self):
        check_str("source", self.source)
        check_str("tokenizer", self.tokenizer, allow_none=True)
        check_int("num_examples", self.num_examples, minimum=1)
        check_int("max_prompt_len", self.max_prompt_len, minimum=1)


@dataclasses.dataclass(frozen=True)
class AlgoSection(Section):
    """RL objective. GRPO defaults; DAPO = clip_high 0.28 + agg token-mean; Dr. GRPO = dr_grpo + seq-mean-token-sum-norm."""

    advantage: str = "grpo"              # advantage estimator: grpo, dr_grpo, rloo, reinforce_pp, gae (PPO: a critic), opd (a teacher)
    group_size: int = 8                  # samples per prompt
    prompts_per_step: int = 16           # global, over all processes
    mini_batches: int = 1                # optimizer updates per rollout batch (>1 makes it off-policy)
    micro_batches: int = 1               # gradient accumulation inside one update
    clip_low: float = 0.2                # PPO ratio clip below: 1 - clip_low
    clip_high: float = 0.2               # PPO ratio clip above: 1 + clip_high (DAPO clip-higher: 0.28)
    dual_clip: float | None = None       # None = off; else c > 1
    agg: str = "token-mean"              # loss aggregation over tokens and sequences (jaxrl.algos)
    kl_coef: float = 0.0                 # KL to the reference policy (0 = no reference forward)
    kl_estimator: str = "k3"             # k1, k2 or k3 (Schulman) estimator of the KL term
    kl_in_reward: bool = False           # gae, reinforce_pp: -kl_coef x KL per token in the reward instead of a loss term
    entropy_coef: float = 0.0            # entropy bonus weight
    gamma: float = 1.0                   # discount (reinforce_pp returns, GAE)
    lam: float = 0.95                    # GAE lambda (algo.advantage=gae)
    objective: str = "ppo"               # ppo, decoupled (AReaL: behaviour weight x proximal clip) or gspo (sequence ratio)
    is_correction: str = "truncate"      # decoupled: the importance weight pi_prox/pi_behav: none, truncate (TIS) or mask (MIS)
    is_cap: float = 2.0                  # decoupled: C of the truncation / mask
    opd: OpdSection = dataclasses.field(default_factory=OpdSection)   # on-policy distillation (advantage=opd)
    graph: str = "default"               # the step's graph (jaxrl.flow): a built-in name (grpo, dapo, rloo, reinforce_pp, ppo) or a .yaml path; default = algo.advantage's

    def __post_init__(self):
        check_choice("advantage", self.advantage, ADVANTAGES)
        check_str("graph", self.graph)
        check_choice("agg", self.agg, AGGREGATIONS)
        check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        check_objective_fields(self)
        for name in ("group_size", "prompts_per_step", "mini_batches", "micro_batches"):
            check_int(name, getattr(self, name), minimum=1)
        for name in ("clip_low", "clip_high", "kl_coef", "entropy_coef", "gamma", "lam"):
            check_float(name, getattr(self, name))
        for name in ("clip_low", "clip_high", "kl_coef"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)}")
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(name, f"must be in [0, 1], got {getattr(self, name)}")
        if self.dual_clip is not None:
            check_float("dual_clip", self.dual_clip, above=1.0)
        if self.kl_in_reward and self.advantage not in KL_IN_REWARD:
            raise ConfigError("kl_in_reward", f"{self.advantage}'s advantages come from outcome rewards only; the "
                              f"per-token KL penalty needs algo.advantage in {KL_IN_REWARD} (or use kl_coef as a "
                              "loss term with kl_in_reward=false)")
        if self.kl_in_reward and not self.kl_coef:
            raise ConfigError("kl_in_reward", "the reward penalty is -kl_coef x KL per token: set algo.kl_coef > 0")
        if self.group_size < 2 and self.advantage in ("grpo", "dr_grpo", "rloo"):
            raise ConfigError("group_size", f"{self.advantage} needs group_size >= 2")


@dataclasses.dataclass(frozen=True)
class TrainerSection(Section):
    """Train-forward options (the gradient step; log-prob passes use `attention_impl` only).

    `remat`: "dots" (default) saves the projection matmuls only and recomputes the rest (norms, RoPE,
    attention, activations) in the backward, "none" saves every residual (most memory), "layer" saves
    each layer's input and recomputes the layer (`models.forward`). On the CPU "dots" is also the
    fastest: the 58M step (32 x 82 tokens) took 4.58 s with dots and 5.04 s with none, with 0.84 vs
    1.88 GiB of temp memory; storing the per-layer residuals through the layer scan costs more than
    recomputing them (README "Throughput").
    `attention_impl`: "xla" or "pallas" (`kernels.attention`; interpret mode on the CPU, slow).
    `fused_loss`: the loss and its lm_head gradient in one pass over token chunks
    (`kernels.logprob_loss`: no logit recomputation in the backward, 6 instead of 8 E·V·T FLOPs; 2-3 %
    of the 58M step on the CPU) at the cost of a float32 [hidden, vocab] gradient accumulator; false:
    vocabulary-chunked log-probs and autodiff (`kernels.logprobs`).
    `micro_batch_tokens`: each update runs the packed batch as micro-batches of exactly
    micro_batch_tokens // pack_len rows (gradients summed, then one optimizer update), so one compiled
    gradient step serves every batch and memory is bounded by the micro-batch; `algo.micro_batches` then
    must stay 1. null: one fused step over the whole batch, rows bucketed (a compile per new row count).
    `warmup`: compile every shape the run can use (rollout buckets, the update) before the first step.
    `background_compile` (with warmup, a run starting at step 0): only what step 0 runs compiles before it
    (each rollout instance's cover shapes, which its rollout rounds every step up to, and the update: on a
    thread beside the warm start); the exact buckets compile when step 0 is done, and step 1's rollout
    waits for them (`jaxrl.train.background`).
    `backward`: "full" differentiates each micro-batch's rows whole; "blockwise" is MetroRLHF's backward
    (`jaxrl.train.blockwise`): blocks of `block_size` tokens from the last to the first, the earlier
    positions' K/V taken from a cache (`kv_source`: "recompute" = one forward pass that keeps only K/V,
    "rollout" = the K/V the engine computed while generating; on-policy only), the same gradient with
    activations for one block instead of the whole row. RL steps only (the warm start has no cache)."""

    remat: str = "dots"                  # dots, none or layer (what the backward recomputes)
    attention_impl: str = "xla"          # xla or pallas
    fused_loss: bool = True              # loss + lm_head gradient in one pass (kernels.logprob_loss)
    micro_batch_tokens: int | None = 2048    # fixed micro-batch (tokens): one compiled step for any batch; null = whole batch
    warmup: bool = True                  # compile every rollout and update shape before the first step
    background_compile: bool = True      # ...only the cover shapes before it, the rest on a thread after step 0
    backward: str = "full"               # full or blockwise (MetroRLHF: blocks last to first over cached K/V)
    block_size: int = 256                # blockwise: tokens per block (T)
    kv_source: str = "recompute"         # blockwise: recompute (forward pass keeping K/V) or rollout (engine's cache)
    stream: StreamSection = dataclasses.field(default_factory=StreamSection)   # RollPacker's stream trainer
    max_staleness: int = 0               # k: generation runs up to k policy versions ahead of training (0: synchronous)
    swap_step: int | None = None         # max_staleness >= 1: the update enters the next rollout at its swap_step-th engine step (null: between rollouts)
    swap_kv: str = "keep"                # swap_step: the in-flight sequences' K/V kept (keep) or recomputed on the new weights
    stale_samples: str = "drop"          # a carried response older than max_staleness versions: drop (generated afresh) or correct (decoupled IS weight)
    repartition: str = "none"            # DistFlow databuffer before packing: none (each process trains its own samples) or tokens (balanced over processes)

    def __post_init__(self):
        check_choice("repartition", self.repartition, REPARTITIONS)
        check_choice("remat", self.remat, REMAT_POLICIES)
        check_choice("attention_impl", self.attention_impl, ATTENTION_IMPLS)
        if self.micro_batch_tokens is not None:
            check_int("micro_batch_tokens", self.micro_batch_tokens, minimum=1)
        check_choice("backward", self.backward, BACKWARDS)
        check_int("block_size", self.block_size, minimum=1)
        check_choice("kv_source", self.kv_source, KV_SOURCES)
        if self.swap_step is not None:
            check_int("swap_step", self.swap_step, minimum=1)
        check_choice("swap_kv", self.swap_kv, SWAP_KV)
        check_choice("stale_samples", self.stale_samples, STALE_RULES)


@dataclasses.dataclass(frozen=True)
class WarmStartSection(Section):
    """Supervised warm start on demonstrations (steps 0 = skip); `batch_size` is global.

    The demonstrations are the built-in tasks' ideal responses, or, with `response_key`, that column of each row
    of `data.source` (e.g. a teacher's sampled responses, for on-policy distillation's student). With other data
    and no `response_key` it is skipped with one line, so recipes written for the built-in tasks still run."""

    steps: int = 0                       # supervised steps before RL (0 = none)
    batch_size: int = 32                 # demonstrations per step, over all processes
    response_key: str | None = None      # a data column holding each row's demonstration (null: the built-in tasks')
    optim: OptimSection = dataclasses.field(default_factory=lambda: OptimSection(lr=3e-3, warmup_steps=20,
                                                                                  schedule="cosine"))

    def __post_init__(self):
        check_int("steps", self.steps, minimum=0)
        check_int("batch_size", self.batch_size, minimum=1)
        check_str("response_key", self.response_key, allow_none=True)


@dataclasses.dataclass(frozen=True)
class RewardSection(Section):
    """How responses are scored (`jaxrl.rewards`): `fn(response: str, answer: str, task: str) -> float`.

    A row's reward is its own `"reward"` field when the data has one, else `fn`, else the task's default
    ("math" for math rows, "builtin" for the built-in tasks). A name is a registered reward ("math",
    "builtin", or a key of `registry`) or an import path "package.module:function" (importable in a fresh
    interpreter: the pool's workers are separate processes). Every name is resolved at start-up, in this
    process and in a worker, before anything compiles. The "code" reward runs programs in a sandbox
    (`sandbox`) with a timeout per test case that adapts to the slowest correct run seen (`adaptive_timeout`). A step in which every reward failed (crash or
    timeout) is counted; `max_failed_steps` such steps in a row stop the run with the first error."""

    fn: str | None = None                # the reward of every row without its own "reward" field
    registry: dict[str, str] = dataclasses.field(default_factory=dict)   # extra names -> "pkg.mod:fn"
    num_workers: int = 2                 # 0 = score in-process (no timeouts; debugging)
    timeout_s: float = 5.0               # per response; a timeout scores 0 and is counted
    max_failed_steps: int = 3            # steps in a row where every reward failed before the run stops
    sandbox: SandboxSection = dataclasses.field(default_factory=SandboxSection)        # the code reward's programs
    adaptive_timeout: AdaptiveTimeoutSection = dataclasses.field(default_factory=AdaptiveTimeoutSection)  # per test case

    def __post_init__(self):
        check_str("fn", self.fn, allow_none=True)
        if not isinstance(self.registry, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and ":" in v for k, v in self.registry.items()):
            raise ConfigError("registry", f"expected a mapping name -> 'package.module:function', got {self.registry!r}")
        check_int("num_workers", self.num_workers, minimum=0)
        check_float("timeout_s", self.timeout_s, above=0.0)
        check_int("max_failed_steps", self.max_failed_steps, minimum=1)


def check_rollout_kv_processes(t: TrainerSection, processes: int) -> None:
    """trainer.kv_source=rollout over `processes` processes (the config's count here, `jax.process_count()` again
    when the update stages them: launch_local.sh sets it in the environment): each process stages its own
    instances' K/V for its own samples, so nothing may move samples between processes."""
    if t.kv_source == "rollout" and processes > 1 and t.repartition == "tokens":
        raise ConfigError("trainer.repartition", f"tokens moves samples to other processes, but with "
                          f"trainer.kv_source=rollout and {processes} processes each sample's K/V stay on the process "
                          "whose instances made them: use repartition=none or kv_source=recompute")


@dataclasses.dataclass(frozen=True)
class DistributedSection(Section):
    """jax.distributed: a null value falls back to JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
    JAX_PROCESS_ID in the environment, then to the launcher jax.distributed detects (mpirun, srun, a Kubernetes
    Indexed Job: `jaxrl.train.distributed.launch`, docs/cluster.md); none of them = single process."""

    coordinator: str | None = None       # host:port of process 0 (JAX_COORDINATOR_ADDRESS)
    num_processes: int | None = None     # processes in the run (JAX_NUM_PROCESSES)
    process_id: int | None = None        # this process, 0..num_processes-1 (JAX_PROCESS_ID)
    initialization_timeout: int = 120    # seconds to wait for every process to join
    heartbeat_timeout: int = 20          # seconds a process may go silent before the others stop (jaxrl.train.heartbeat)

    def __post_init__(self):
        check_str("coordinator", self.coordinator, allow_none=True)
        if self.num_processes is not None:
            check_int("num_processes", self.num_processes, minimum=1)
        if self.process_id is not None:
            check_int("process_id", self.process_id, minimum=0)
        check_int("initialization_timeout", self.initialization_timeout, minimum=1)
        check_int("heartbeat_timeout", self.heartbeat_timeout, minimum=1)


@dataclasses.dataclass(frozen=True)
class TrainConfig(Section):
    """Training layout (`train_layout`, over all devices of all processes) and rollout shape (`engine`:
    instances x tp on each process's local devices) are colocated on the same devices."""

    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    train_layout: LayoutSection = dataclasses.field(default_factory=LayoutSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    rollout: TrainSamplingSection = dataclasses.field(default_factory=TrainSamplingSection)
    engine: TrainEngineSection = dataclasses.field(default_factory=TrainEngineSection)
    algo: AlgoSection = dataclasses.field(default_factory=AlgoSection)
    optim: OptimSection = dataclasses.field(default_factory=OptimSection)
    critic: CriticSection = dataclasses.field(default_factory=CriticSection)     # PPO's value model (algo.advantage=gae)
    trainer: TrainerSection = dataclasses.field(default_factory=TrainerSection)
    warm_start: WarmStartSection = dataclasses.field(default_factory=WarmStartSection)
    rewards: RewardSection = dataclasses.field(default_factory=RewardSection)
    eval: EvalSection = dataclasses.field(default_factory=EvalSection)   # held-out evaluation (off unless eval.data/split)
    teacher: TeacherSection = dataclasses.field(default_factory=TeacherSection)   # on-policy distillation's teacher (advantage=opd)
    distributed: DistributedSection = dataclasses.field(default_factory=DistributedSection)
    placement: str = "colocated"         # colocated (rollout and training share devices) or disaggregated (StreamRL: own pools)
    stage_balance: StageBalanceSection = dataclasses.field(default_factory=StageBalanceSection)   # StreamRL scale-up
    steps: int = 100                     # RL steps in the run (a resume continues up to this)
    time_budget_min: float | None = None  # stop cleanly after the RL step that passes this many minutes of RL (checkpointed; rerun to continue)
    seed: int = 0                        # data order, sampling and initial weights
    run_dir: str = "runs/quickstart"     # outputs: metrics, curves, TensorBoard, checkpoints, hf/ (--run-dir)
    save_every: int | None = 10          # None = only at the end
    keep_checkpoints: int = 3            # newest checkpoints kept
    export_hf: bool = True               # write run_dir/hf (HF checkpoint with tokenizer) at the end
    curves: bool = True                  # draw run_dir/curves.png at the end (matplotlib: ~0.7 s a run)
    log_completions: int = 4             # completions per RL step to run_dir/samples.jsonl and TensorBoard (0: none)
    pack_len: int | None = None          # None = max_prompt_len + max_new_tokens (rounded up to 32)
    profile_steps: tuple[int, int] | None = None   # [start, stop]: jax.profiler trace of RL steps start..stop-1

    def __post_init__(self):
        check_sections(self)
        check_int("steps", self.steps, minimum=0)
        if self.time_budget_min is not None:
            check_float("time_budget_min", self.time_budget_min, above=0.0)
        check_int("seed", self.seed, minimum=0)
        check_str("run_dir", self.run_dir)
        if self.save_every is not None:
            check_int("save_every", self.save_every, minimum=1)
        check_int("keep_checkpoints", self.keep_checkpoints, minimum=1)
        check_int("log_completions", self.log_completions, minimum=0)
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
        if self.trainer.micro_batch_tokens is not None and self.algo.micro_batches != 1:
            raise ConfigError("algo.micro_batches", f"{self.algo.micro_batches} with trainer.micro_batch_tokens="
                              f"{self.trainer.micro_batch_tokens}: the micro-batches already come from the token "
                              "budget; set algo.micro_batches=1 (or trainer.micro_batch_tokens=null)")
        check_declarations(self)      # refusals between mechanisms, from what each decides and needs
        check_critic(self)            # before the mechanisms' own checks: PPO refuses them whole
        self._check_multi_turn()
        self._check_blockwise()
        check_stream(self.trainer.stream, self)
        check_placement(self)
        check_objective(self)
        check_distill(self)
        check_carry(self)
        longest = self.data.max_prompt_len + self.rollout.max_new_tokens
        if longest > self.engine.max_seq_len:
            raise ConfigError("engine.max_seq_len", f"data.max_prompt_len {self.data.max_prompt_len} + "
                              f"rollout.max_new_tokens {self.rollout.max_new_tokens} = {longest} tokens > "
                              f"engine.max_seq_len={self.engine.max_seq_len}; raise engine.max_seq_len or lower one "
                              "of the two")


    def _check_multi_turn(self):
        """Multi-turn (rollout.env) combinations that would train on the observations, refused with the reason."""
        if getattr(self.rollout, "env", None) is None:    # (a plain SamplingSection has no environment)
            return
        if self.algo.kl_in_reward:
            raise ConfigError("rollout.env", "algo.kl_in_reward would put the observation tokens' KL into the "
                              "returns: use kl_coef as a loss term (kl_in_reward=false) with multi-turn")

    def _check_blockwise(self):
        """trainer.backward / kv_source combinations that cannot run, refused with the key and the reason."""
        t = self.trainer
        if t.backward == "blockwise" and t.micro_batch_tokens is None:
            raise ConfigError("trainer.backward", "blockwise runs per fixed-shape micro-batch: set "
                              "trainer.micro_batch_tokens (null selects the fused whole-batch step)")
        if t.kv_source == "rollout":
            if t.backward != "blockwise":
                raise ConfigError("trainer.kv_source", "rollout K/V are consumed by trainer.backward=blockwise only")
            if self.algo.mini_batches > 1:
                raise ConfigError("trainer.kv_source", f"rollout K/V are the rollout policy's; with algo.mini_batches="
                                  f"{self.algo.mini_batches} every update after the first trains weights that moved "
                                  "(off-policy): use kv_source=recompute or mini_batches=1")
            check_rollout_kv_processes(t, self.distributed.num_processes or 1)