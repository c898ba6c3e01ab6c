"""Config of on-policy distillation (algo.advantage=opd, the `opd` graph; the component is
`jaxrl.train.teacher`, the nodes `jaxrl.flow.opd`):

    algo:
      advantage: opd
      opd:
        reward_weight: 0.0      # x the task reward's group advantage (GRPO's), added to every token's term
        kl_clip: 10.0           # |log pi_teacher - log pi_student| per token is clipped to this (null: no clip)
        student_logp: rollout   # the student's log-probs: the engine's (rollout) or the trainer's forward (trainer)
    teacher:
      hf_path: DIR              # an HF checkpoint sharing the student's tokenizer (null: the reference policy)
      layout: null              # its own sharding layout (null: train_layout's; with placement=pool: fsdp over the pool)
      placement: colocated      # colocated (the train devices) or pool (`devices` of each process's own)
      devices: 0                # placement=pool: the teacher's devices on each process, beside the run's others

`check_distill(cfg)` refuses, naming the key, what the teacher cannot run with; the refusals between
mechanisms are declared in `jaxrl.config.declarations` (`token_scores`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from .base import ConfigError, Section, check_choice, check_float, check_int, check_str
from .sections import LayoutSection

if TYPE_CHECKING:
    from .train import TrainConfig

STUDENT_LOGP = ("rollout", "trainer")
PLACEMENTS = ("colocated", "pool")


@dataclasses.dataclass(frozen=True)
class OpdSection(Section):
    """The per-token advantage of on-policy distillation (GKD, Agarwal et al. 2024, in its reverse-KL form):
    A_t = clip(log π_T(y_t|·) − log π_S(y_t|·), ±kl_clip) + reward_weight · Â_group, where Â_group is GRPO's
    group advantage of the task reward (0 when reward_weight is 0). `student_logp`: "rollout" takes log π_S
    from the engine that sampled y (free, and the behaviour policy's in an asynchronous run); "trainer"
    recomputes it with the trainer's forward on the weights that sampled (exactly 0 when the teacher is the
    student; synchronous runs only)."""

    reward_weight: float = 0.0           # x the task reward's group advantage (0: distillation alone)
    kl_clip: float | None = 10.0         # bound on |log pi_teacher - log pi_student| per token (null: none)
    student_logp: str = "rollout"        # rollout (the engine's log-probs) or trainer (recomputed by the trainer)

    def __post_init__(self):
        check_float("reward_weight", self.reward_weight)
        if self.reward_weight < 0:
            raise ConfigError("reward_weight", f"must be >= 0, got {self.reward_weight}")
        if self.kl_clip is not None:
            check_float("kl_clip", self.kl_clip, above=0.0)
        check_choice("student_logp", self.student_logp, STUDENT_LOGP)


@dataclasses.dataclass(frozen=True)
class TeacherSection(Section):
    """The teacher of algo.advantage=opd: a frozen model whose per-token log-probs of the student's sampled
    tokens make the advantage. `hf_path`: an HF directory whose tokenizer equals the student's (any
    architecture of the Llama/Qwen families; checked at start-up); null = the run's reference policy (with
    LoRA the student's own base, else the weights RL starts from). `placement`: colocated (on the train
    devices, sharded by `layout`, default train_layout's) or pool (on `devices` devices of its own on each
    process, beside the train mesh and the rollout instances, as StreamRL's train pool is beside its generation
    pool; sharded by `layout`, default fsdp over the pool). Simplified: a pool is built beside colocated
    training only (not beside placement=disaggregated's two pools yet)."""

    hf_path: str | None = None           # HF checkpoint sharing the student's tokenizer (null: the reference policy)
    layout: LayoutSection | None = None  # its own sharding layout (null: train_layout's; pool: fsdp over the pool)
    placement: str = "colocated"         # colocated (the train devices) or pool (`devices` of its own per process)
    devices: int = 0                     # placement=pool: the teacher's own devices on each process

    def __post_init__(self):
        check_str("hf_path", self.hf_path, allow_none=True)
        check_choice("placement", self.placement, PLACEMENTS)
        check_int("devices", self.devices, minimum=0)
        if (self.placement == "pool") != (self.devices > 0):
            raise ConfigError("devices", f"{self.devices} with placement={self.placement}: a pool needs devices >= 1, "
                              "and only a pool has devices of its own")


def check_distill(cfg: "TrainConfig") -> None:
    """algo.advantage=opd's own needs (one line, naming the key): the teacher scores the update's fixed
    micro-batches; a teacher section without OPD is a mistake; its layout covers the train devices."""
    a, t = cfg.algo, cfg.teacher
    if a.advantage != "opd":
        if t.hf_path is not None or t.layout is not None or t.placement != "colocated":
            raise ConfigError("teacher", f"a teacher is used by algo.advantage=opd only (algo.advantage="
                              f"{a.advantage}); set algo.advantage=opd or drop the teacher section")
        return
    if cfg.trainer.micro_batch_tokens is None:
        raise ConfigError("trainer.micro_batch_tokens", "null with algo.advantage=opd: the teacher scores the "
                          "update's fixed micro-batches; set a token budget (e.g. 2048)")
    if t.placement == "pool":
        if t.hf_path is None:
            raise ConfigError("teacher.placement", "pool with teacher.hf_path=null: the reference teacher is the "
                              "student's own weights, on the train devices; give a teacher checkpoint to pool")
        if cfg.placement != "colocated":
            raise ConfigError("teacher.placement", f"pool with placement={cfg.placement}: a teacher pool beside "
                              "StreamRL's two pools is not built yet; use teacher.placement=colocated")
        return
    if t.layout is not None and t.layout.num_devices != cfg.train_layout.num_devices:
        raise ConfigError("teacher.layout", f"{t.layout.num_devices} devices, but the teacher runs on the train "
                          f"layout's {cfg.train_layout.num_devices}: give dp x fsdp x tp = "
                          f"{cfg.train_layout.num_devices}")


def needs_reference(cfg: "TrainConfig") -> bool:
    """Whether the run holds a reference policy: the KL term's (algo.kl_coef), or the teacher when
    teacher.hf_path is null (with LoRA the base; else a copy of the weights RL starts from, checkpointed)."""
    return bool(cfg.algo.kl_coef) or (cfg.algo.advantage == "opd" and cfg.teacher.hf_path is None)


def teacher_devices(cfg: "TrainConfig") -> int:
    """The devices each process gives the teacher's pool (0: none; teacher.placement=pool)."""
    return cfg.teacher.devices if cfg.algo.advantage == "opd" and cfg.teacher.placement == "pool" else 0
