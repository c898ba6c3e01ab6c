"""The simulator's config (`python -m jaxrl.sim --config configs/sim/FILE.yaml key=value ...`).

The mechanisms are configured by the training config's own sections under the same keys
(`rollout.tail_batching`, `rollout.skew`, `engine.adaptive_tp`, `engine.planner`, `trainer.stream`,
`algo`), and every row of the comparison is turned into a real `TrainConfig` (`train_config`), so a
combination a training run refuses is refused here with the same message. What only the simulator has:
`cluster` (GPUs, the cost model), `workload` (the response lengths) and `rows` (which mechanism sets to
compare, each against the baseline).

A row is a name from `ROWS` or mechanism names joined by "+" (e.g. "tail_batching+pat"):

| mechanism | what it turns on |
|---|---|
| pat | PAT: `engine.adaptive_tp` (the controller switches TP mid-generation) |
| tail_batching | RollPacker: speculative short rounds, the long-prompt queue, long rounds |
| planner | RollPacker: per-round-type TP from preemption counts (`engine.planner`) |
| async_reward | RollPacker: rewards scored as responses finish, adaptive code timeouts (off: after the rollout, fixed T_max) |
| stream_trainer | RollPacker: gradients on rollout devices freed mid-rollout (`trainer.stream`) |
| skew | StreamRL: long-tail prompts to dedicated instances, LPT order (`rollout.skew`; the ranker is the workload's own lengths, blurred by `ranker_noise`) |
| disaggregated | StreamRL: generation and training on their own GPUs (split by `train.balance.best_split`, see `split`), samples streamed |
| async_steps | StreamRL's one-step-async, generalised: generation up to `max_staleness` policy versions ahead of training (the next rollouts run while this step trains; needs disaggregated) |
| multi_controller | DistFlow: no central driver (off: every sample crosses the driver at each stage boundary) |

The baseline (no mechanism) is what veRL does: colocated, synchronous, static TP, rewards after the
rollout, a single controller.
"""

from __future__ import annotations

import dataclasses

from jaxrl.config.base import ConfigError, Section, check_choice, check_float, check_int
from jaxrl.config.sections import ModelSection
from jaxrl.config.stream import StreamSection
from jaxrl.config.train import AlgoSection, DataSection, TrainConfig, TrainerSection
from jaxrl.config.train_rollout import TrainEngineSection, TrainSamplingSection
from models import PRESETS as MODEL_PRESETS

from .hardware import PRESETS as GPU_PRESETS
from .workload import Workload

MECHANISMS = ("pat", "tail_batching", "planner", "async_reward", "stream_trainer", "skew", "disaggregated",
              "async_steps", "multi_controller")

ROWS: dict[str, tuple[str, ...]] = {
    "baseline": (),
    "pat": ("pat",),
    "tail_batching": ("tail_batching",),
    "rollpacker": ("tail_batching", "async_reward", "planner", "stream_trainer"),
    "streamrl": ("disaggregated", "skew", "async_reward"),
    "distflow": ("multi_controller",),
    "all": ("multi_controller", "tail_batching", "async_reward", "planner", "pat"),
}


def mechanisms_of(row: str) -> tuple[str, ...]:
    """The mechanism set a row name stands for (a `ROWS` name, or mechanisms joined by "+")."""
    if row in ROWS:
        return ROWS[row]
    names = tuple(n for n in row.split("+") if n)
    bad = [n for n in names if n not in MECHANISMS]
    if bad or not names:
        raise ConfigError("rows", f"{row!r}: not a row name ({', '.join(ROWS)}) nor mechanisms joined by '+' "
                          f"(valid: {', '.join(MECHANISMS)})")
    return names


@dataclasses.dataclass(frozen=True)
class ClusterSection(Section):
    """The GPUs and how long their work takes: the analytic model of `gpu` (`jaxrl.sim.hardware`), or a latency
    profile JSON measured by `python -m jaxrl.rollout.profile` (`profile`; then `*_s_per_token` and `sync_s`
    time the training side, e.g. from a run's metrics)."""

    gpu: str = "h100"                       # analytic cost model: h100, h800 or a40
    gpus: int = 8                           # GPUs in all (rollout and training)
    profile: str | None = None              # a PAT latency profile JSON: cost model (a) instead of the analytic one
    dtype: str = "bfloat16"                 # weights and KV: bfloat16 or float32
    train_s_per_token: float = 0.0          # profile cost model: policy update seconds per trained token
    forward_s_per_token: float = 0.0        # profile cost model: one log-prob forward, seconds per token
    sync_s: float = 0.0                     # profile cost model: the per-step weight sync
    reward_workers: int = 64                # CPU reward workers
    reward_timeout_s: float = 30.0          # T_max of a response's reward
    driver_s_per_token: float = 1.39e-5     # single controller: the driver's seconds per token of the step's samples (fitted: DistFlow)
    sample_bytes_per_token: int = 48        # a sample's fields per token (ids, masks, positions, log-probs, ...): repartition bytes
    host_step_s: float = 0.0                # host time per engine step, beside the device's

    def __post_init__(self):
        check_choice("dtype", self.dtype, ("bfloat16", "float32"))
        check_int("gpus", self.gpus, minimum=1)
        check_int("reward_workers", self.reward_workers, minimum=1)
        check_float("reward_timeout_s", self.reward_timeout_s, above=0.0)
        check_int("sample_bytes_per_token", self.sample_bytes_per_token, minimum=1)
        for name in ("train_s_per_token", "forward_s_per_token", "sync_s", "host_step_s", "driver_s_per_token"):
            check_float(name, getattr(self, name))
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)}")
        if self.profile is None:
            check_choice("gpu", self.gpu, GPU_PRESETS)

    @property
    def dtype_bytes(self) -> int:
        return 2 if self.dtype == "bfloat16" else 4


@dataclasses.dataclass(frozen=True)
class WorkloadSection(Section):
    """Response lengths and rewards (`jaxrl.sim.workload`): a parametric long tail (lognormal from `median` and
    the fraction `above_fraction` of responses longer than `above`), a JSONL trace (`path`), or a run directory's
    length pairs (`run`)."""

    source: str = "parametric"              # parametric, jsonl or run
    path: str | None = None                 # jsonl: the trace file; run: the run directory
    prompts: int = 40000                    # dataset size (parametric)
    prompt_len: int = 256                   # prompt tokens (parametric)
    median: float = 2931.0                  # median response length (tokens)
    above: int = 8192                       # ... with this fraction of responses longer than `above`
    above_fraction: float = 0.11
    prompt_share: float = 0.5               # share of the log-length variance that is the prompt's (rest: per sample)
    pass_a: float = 1.0                     # per-prompt pass rate ~ Beta(pass_a, pass_b)
    pass_b: float = 1.0
    reward_s: float = 0.05                  # seconds to score one response (rule-based)
    code: bool = False                      # code tasks: programs run code_median_s, a fraction `hang` never end
    code_fraction: float = 1.0              # with code: the share of prompts that are code tasks
    code_median_s: float = 0.3
    hang: float = 0.0
    cap_fraction: float = 0.0               # responses that run to max_new_tokens whatever their draw
    seed: int = 0

    def __post_init__(self):
        check_choice("source", self.source, ("parametric", "jsonl", "run"))
        if self.source != "parametric" and not self.path:
            raise ConfigError("path", f"source={self.source} needs a path")
        check_int("prompts", self.prompts, minimum=1)
        check_int("prompt_len", self.prompt_len, minimum=1)
        for name in ("median", "above_fraction", "pass_a", "pass_b", "code_median_s"):
            check_float(name, getattr(self, name), above=0.0)
        for name in ("hang", "prompt_share", "code_fraction", "cap_fraction"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise ConfigError(name, f"must be in [0, 1], got {v!r}")

    def build(self, max_new_tokens: int):
        common = dict(reward_s=self.reward_s, code=self.code, code_median_s=self.code_median_s, hang=self.hang,
                      seed=self.seed, pass_beta=(self.pass_a, self.pass_b), code_fraction=self.code_fraction,
                      cap_fraction=self.cap_fraction)
        if self.source == "jsonl":
            return Workload.from_jsonl(self.path, max_new_tokens=max_new_tokens, **common)
        if self.source == "run":
            return Workload.from_run(self.path, max_new_tokens=max_new_tokens, **common)
        return Workload.parametric(prompts=self.prompts, max_new_tokens=max_new_tokens, median=self.median,
                                   p_above=((self.above, self.above_fraction),), prompt_len=self.prompt_len,
                                   prompt_share=self.prompt_share, **common)


SPLITS = ("scaled", "simulated")


@dataclasses.dataclass(frozen=True)
class SimConfig(Section):
    """`python -m jaxrl.sim`: simulate `steps` RL steps of every row on a virtual clock."""

    model: str = "llama3.1-8b"              # a models preset (shapes only)
    cluster: ClusterSection = dataclasses.field(default_factory=ClusterSection)
    workload: WorkloadSection = dataclasses.field(default_factory=WorkloadSection)
    rollout: TrainSamplingSection = dataclasses.field(
        default_factory=lambda: TrainSamplingSection(max_new_tokens=24576))
    engine: TrainEngineSection = dataclasses.field(
        default_factory=lambda: TrainEngineSection(tp=2, instances=4, max_batch=256, max_seq_len=24832))
    algo: AlgoSection = dataclasses.field(default_factory=lambda: AlgoSection(prompts_per_step=128, group_size=8))
    stream: StreamSection = dataclasses.field(default_factory=lambda: StreamSection(enabled=True))   # trainer.stream when the row has stream_trainer
    rows: tuple[str, ...] = ("baseline", "pat", "tail_batching", "rollpacker", "streamrl", "distflow", "all")
    steps: int = 10                         # RL steps per row (a tail-batching period is 5)
    prompts_per_gpu: int | None = None      # set: algo.prompts_per_step = this x cluster.gpus (weak scaling)
    max_staleness: int = 1                  # async_steps rows: generation up to this many versions ahead (trainer.max_staleness)
    # disaggregated rows' GPU split, max(T_g(x), T_t(y)) smallest (StreamRL §4.2), T_t scaled from the baseline's
    # training as work / GPUs; T_g: scaled the same way (scaled), or the row's first rollout simulated on x
    # GPUs (simulated: a long tail does not shrink with more GPUs; O(log GPUs) rollouts, balance.searched_split)
    split: str = "scaled"
    ranker_noise: float = 0.0               # skew: predicted length = the prompt's true mean x exp(noise x N(0,1)) (0: oracle)
    seed: int = 0
    sweep: str | None = None                # a dotted key to sweep (e.g. cluster.gpus), with `values`
    values: tuple[str, ...] = ()            # the sweep's values (parsed by the key's type)
    out: str = "runs/sim"                   # summary.json, figures

    def __post_init__(self):
        check_int("steps", self.steps, minimum=1)
        if self.prompts_per_gpu is not None:
            check_int("prompts_per_gpu", self.prompts_per_gpu, minimum=1)
        for r in self.rows:
            mechanisms_of(r)
        check_int("max_staleness", self.max_staleness, minimum=1)
        check_choice("split", self.split, SPLITS)
        check_float("ranker_noise", self.ranker_noise)
        if self.ranker_noise < 0:
            raise ConfigError("ranker_noise", f"must be >= 0, got {self.ranker_noise}")
        if self.sweep is not None and not self.values:
            raise ConfigError("values", f"sweep={self.sweep} needs values")
        check_choice("model", self.model, MODEL_PRESETS)
        if self.rollout.tail_batching.carry_partial:
            raise ConfigError("rollout.tail_batching.carry_partial", "the simulator does not model carried partial "
                              "responses (its engine cannot resume one)")


def train_config(cfg: SimConfig, mechanisms, *, gen_gpus: int, profile: str | None, prompt_len: int):
    """The `TrainConfig` of a row (its checks refuse what a training run refuses)."""
    m = set(mechanisms)
    e, r = cfg.engine, cfg.rollout
    if gen_gpus % e.tp:
        raise ConfigError("engine.tp", f"{e.tp} does not divide the rollout pool's {gen_gpus} GPUs")
    # the engine's pools come from the cost model's memory budget (`cost.pages`); the planner's check wants one said
    budget = e.kv_memory_fraction if (e.kv_memory_fraction or e.kv_bytes_per_device or e.num_pages) else 0.85
    if {"stream_trainer", "disaggregated"} <= m and "async_steps" not in m:
        raise ConfigError("trainer.stream.enabled", "true with disaggregated: the simulator times the stream trainer "
                          "on colocated pools only (a training run composes them: the freed devices join the train "
                          f"pool's stream) (simulator row with {'+'.join(sorted(m))})")
    try:
        return TrainConfig(
            model=ModelSection(preset=cfg.model, dtype=cfg.cluster.dtype),
            data=DataSection(max_prompt_len=prompt_len),
            rollout=dataclasses.replace(r, tail_batching=dataclasses.replace(r.tail_batching, enabled="tail_batching" in m),
                                        skew=dataclasses.replace(r.skew, enabled="skew" in m)),
            engine=dataclasses.replace(e, instances=gen_gpus // e.tp, kv_memory_fraction=budget,
                                       adaptive_tp=dataclasses.replace(e.adaptive_tp, enabled="pat" in m, warm=True,
                                                                       profile=profile if "pat" in m else e.adaptive_tp.profile),
                                       planner=dataclasses.replace(e.planner, enabled="planner" in m)),
            algo=cfg.algo,
            trainer=TrainerSection(stream=dataclasses.replace(cfg.stream, enabled="stream_trainer" in m),
                                   max_staleness=cfg.max_staleness if "async_steps" in m else 0),
            placement="disaggregated" if m & {"disaggregated", "async_steps"} else "colocated",
            seed=cfg.seed, steps=cfg.steps)
    except ConfigError as err:
        raise ConfigError(err.key, f"{err.message} (simulator row with {'+'.join(sorted(m)) or 'baseline'})") from None
