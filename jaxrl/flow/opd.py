"""On-policy distillation's nodes (the `opd` graph, algo.advantage=opd; `jaxrl.algos.distill` has the math,
`jaxrl.train.teacher` the teacher):

    (teacher, model_inference)  teacher        the teacher's log-prob of every sampled response token
                                               -> data.teacher_logp (and, with algo.opd.student_logp=trainer,
                                               the student's from the trainer's forward -> data.student_logp)
    opd_advantage (named)       role advantage A_t = clip(lp_T − lp_S, ±kl_clip) + reward_weight · Â_group,
                                               the training samples, and the opd/ metrics

The teacher scores the update's packed micro-batches of the step's sequences (`ppo.sequences`, packed once per
step on this process); per-token values come back per sample from this process's rows. Multi-turn: the
observation tokens are context (scored, then masked out of the advantage, the metrics and the loss).
Asynchronous runs: the student's log-probs are the engine's (the behaviour policy that sampled the tokens).
"""

from __future__ import annotations

import numpy as np

from jaxrl import algos
from jaxrl.train import rl
from jaxrl.train.batch import trained_mask
from jaxrl.train.distributed import gather_ragged, global_sum

from .context import FlowContext
from .data import StepData
from .nodes import make_samples
from .ppo import per_response, sequences
from .registry import register


@register("teacher", "model_inference", name="teacher")
def teacher(ctx: FlowContext, data: StepData) -> None:
    """The teacher's log-probs of the sampled tokens (and the trainer's student log-probs when asked)."""
    tc = ctx.train
    comp, pol = tc.component("teacher"), tc.policy
    mbs, _, _ = sequences(tc, data)
    data.teacher_logp = per_response(tc, data, [comp.logprobs(mb, pol) for mb in mbs])
    if tc.cfg.algo.opd.student_logp == "trainer":
        data.student_logp = per_response(tc, data, [tc.update.updater.logprobs(pol.params, mb) for mb in mbs])


def token_masks(data: StepData) -> list[np.ndarray]:
    """Per sample, 1 on the response tokens the student sampled (multi-turn: 0 on observations)."""
    out = []
    for c in data.completions:
        m = trained_mask(c)
        out.append(np.ones(len(c.tokens), np.float32) if m is None else np.asarray(m, np.float32))
    return out


def advantages(cfg, data: StepData) -> tuple[list[np.ndarray], dict]:
    """Per-sample token advantages (algo.opd) and the step's opd/ metrics over every process's tokens."""
    o, lens = cfg.algo.opd, data.lens
    student = data.student_logp if data.student_logp is not None else [np.asarray(c.logprobs) for c in data.completions]
    T = rl.token_width(cfg, lens)
    mask = rl.padded(token_masks(data), T)
    t, s = rl.padded(data.teacher_logp, T), rl.padded(student, T)
    rewards = np.asarray(data.rewards, np.float32).reshape(-1, data.group_size)
    adv = np.asarray(rl.jitted(algos.compute_advantages, name="opd", reward_weight=o.reward_weight,
                               kl_clip=o.kl_clip)(teacher_logp=t, student_logp=s, mask=mask, rewards=rewards))
    term = np.asarray(rl.jitted(algos.opd_token_terms, kl_clip=o.kl_clip)(t, s, mask))
    on = mask > 0
    return [adv[i, :n] for i, n in enumerate(lens)], metrics(s[on] - t[on], t[on], np.abs(term[on]),
                                                              np.abs(adv[on] - term[on]))


def metrics(reverse_kl: np.ndarray, teacher_logp: np.ndarray, kl_part: np.ndarray, reward_part: np.ndarray) -> dict:
    """opd/: the per-token reverse-KL estimate log π_S − log π_T (mean, p90), the teacher's log-prob of the
    sampled tokens, and the share of |A| that comes from the task reward; over all processes' tokens."""
    kl = gather_ragged(reverse_kl.astype(np.float64), tag="opd")
    tl, kp, rp = global_sum([float(teacher_logp.sum()), float(kl_part.sum()), float(reward_part.sum())], tag="opd")
    n = max(len(kl), 1)
    return {"opd/reverse_kl": float(kl.sum()) / n, "opd/reverse_kl_p90": float(np.percentile(kl, 90)) if len(kl) else 0.0,
            "opd/teacher_logp": tl / n, "opd/reward_share": rp / (kp + rp) if kp + rp > 0 else 0.0}


@register(name="opd_advantage")
def opd_advantage(ctx: FlowContext, data: StepData) -> None:
    """On-policy distillation's advantages (needs the teacher node's log-probs) and the training samples."""
    if data.teacher_logp is None:
        raise RuntimeError(f"node {ctx.node.id!r}: algo.advantage=opd needs the teacher's log-probs (data."
                           "teacher_logp) from a teacher node before the advantages (the built-in `teacher`)")
    data.advantages, m = advantages(ctx.train.cfg, data)
    data.metrics.update(m)
    data.samples = make_samples(data)
