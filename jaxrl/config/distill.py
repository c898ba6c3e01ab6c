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
      layout: null              # the teacher's own sharding layout over the train devices (null: train_layout)

`check_distill(cfg)` refuses, naming the key, what the teacher cannot run with; the refusals between
mechanisms are declared in `jaxrl.config.declarations` (`token_scores`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from .base import ConfigError, Section, check_choice, check_float, check_str
from .sections import LayoutSection

if TYPE_CHECKING:
    from .train import TrainConfig

STUDENT_LOGP = ("rollout", "trainer")
PLACEMENTS = ("colocated",)


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
    LoRA the student's own base, else the weights RL starts from). `layout`: its own dp x fsdp x tp layout
    over the train devices (null: train_layout's); `placement`: colocated (on the train devices, between
    the rollout and the update). Simplified: a pool of its own devices is not built yet."""

    hf_path: str | None = None           # HF checkpoint sharing the student's tokenizer (null: the reference policy)
    layout: LayoutSection | None = None  # its own sharding layout over the train devices (null: train_layout)
    placement: str = "colocated"         # colocated: on the train devices (a pool of its own: not built yet)

    def __post_init__(self):
        check_str("hf_path", self.hf_path, allow_none=True)
        check_choice("placement", self.placement, PLACEMENTS)


def check_distill(cfg: "TrainConfig") -> None:
    """algo.advantage=opd's own needs (one line, naming the key): the teacher scores the update's fixed
    micro-batches; a teacher section without OPD is a mistake; its layout covers the train devices."""
    a, t = cfg.algo, cfg.teacher
    if a.advantage != "opd":
        if t.hf_path is not None or t.layout is not None:
            raise ConfigError("teacher", f"a teacher is used by algo.advantage=opd only (algo.advantage="
                              f"{a.advantage}); set algo.advantage=opd or drop the teacher section")
        return
    if cfg.trainer.micro_batch_tokens is None:
        raise ConfigError("trainer.micro_batch_tokens", "null with algo.advantage=opd: the teacher scores the "
                          "update's fixed micro-batches; set a token budget (e.g. 2048)")
    if t.layout is not None and t.layout.num_devices != cfg.train_layout.num_devices:
        raise ConfigError("teacher.layout", f"{t.layout.num_devices} devices, but the teacher runs on the train "
                          f"layout's {cfg.train_layout.num_devices}: give dp x fsdp x tp = "
                          f"{cfg.train_layout.num_devices}")


def needs_reference(cfg: "TrainConfig") -> bool:
    """Whether the run holds a reference policy: the KL term's (algo.kl_coef), or the teacher when
    teacher.hf_path is null (with LoRA the base; else a copy of the weights RL starts from, checkpointed)."""
    return bool(cfg.algo.kl_coef) or (cfg.algo.advantage == "opd" and cfg.teacher.hf_path is None)
