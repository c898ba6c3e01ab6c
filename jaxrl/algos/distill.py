"""On-policy distillation's per-token advantage (`opd` in the advantage registry).

    adv = compute_advantages("opd", teacher_logp=t, student_logp=s, mask=m, rewards=r.reshape(P, G),
                             reward_weight=0.5, kl_clip=10.0)                               # [P*G, T]

GKD (Agarwal et al. 2024, "On-Policy Distillation of Language Models") in the reverse-KL form most RL
systems use (verl's OPD, slime's --use-opd, prime-rl's algo.type=opd): the student samples y, the teacher
scores each sampled token, and

    A_t = clip(log π_T(y_t | y_<t) − log π_S(y_t | y_<t), −c, c) + w · Â_group

where log π_S − log π_T at the sampled token is a one-sample estimate of the reverse KL KL(π_S ‖ π_T) at
position t (so A_t is its negative), c = `kl_clip` (None: no clip) and Â_group the task reward's GRPO
group advantage, weighted by w = `reward_weight` (0: no task reward). The update is then the usual clipped
policy gradient on A.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .advantages import grpo_advantages, register_advantage
from .masked import as_mask, check_shapes


def opd_token_terms(teacher_logp, student_logp, mask, *, kl_clip: float | None = None) -> jax.Array:
    """clip(log π_T − log π_S, ±kl_clip) per token, 0 on padding; [B, T]."""
    mask = as_mask(mask, what="opd")
    check_shapes("opd", teacher_logp=teacher_logp, student_logp=student_logp, mask=mask)
    term = jnp.asarray(teacher_logp, jnp.float32) - jnp.asarray(student_logp, jnp.float32)
    if kl_clip is not None:
        term = jnp.clip(term, -kl_clip, kl_clip)
    return jnp.where(mask > 0, term, 0.0)


@register_advantage("opd")
def opd_advantages(teacher_logp, student_logp, mask, *, rewards=None, reward_weight: float = 0.0,
                   kl_clip: float | None = None) -> jax.Array:
    """The distillation term per token plus `reward_weight` × the GRPO advantage of `rewards` [P, G] (rows
    prompt-major, as the group estimators take them; ignored when reward_weight is 0).

    teacher_logp, student_logp, mask [B, T] -> token advantages [B, T], 0 on padding.
    """
    adv = opd_token_terms(teacher_logp, student_logp, mask, kl_clip=kl_clip)
    if reward_weight:
        if rewards is None:
            raise ValueError("opd: reward_weight > 0 needs the task rewards [P, G]")
        adv = adv + reward_weight * grpo_advantages(rewards, mask)
    return adv
