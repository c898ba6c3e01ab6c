"""Off-policy corrections for asynchronous RL: the samples were drawn by a behaviour policy that is not the
policy being trained (older weights, several weights versions within one sequence, or the same weights run by
another engine in another precision). Pure functions of per-token [B, T] arrays, as `losses.py`.

    w, m = importance_weights(prox_logp, behav_logp, mask, cap=2.0, mode="truncate")     # TIS / MIS
    loss, m = decoupled_policy_loss(logp, prox_logp, behav_logp, adv, mask, is_cap=2.0)  # AReaL
    loss, m = gspo_policy_loss(logp, old_logp, adv, mask)                                # GSPO, sequence-level
    keep = staleness_mask(token_versions, trained_version, max_staleness=2, mask=mask)

**Decoupled PPO** (AReaL, Fu et al. 2025, arXiv:2505.24298, eq. 5): the importance weight and the trust region
use two policies, the behaviour one that sampled (π_behav, each token's own, whatever weights version it came
from) and a proximal one (π_prox, the weights at the start of the update):

    J(θ) = E[ Σ_t  π_prox(y_t)/π_behav(y_t) · min(u_t·A_t, clip(u_t, 1−ε_low, 1+ε_high)·A_t) ],  u_t = π_θ/π_prox

**Truncated importance sampling** (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy
RL Training"): the same weight for a sampler/trainer mismatch (π_behav the rollout engine's log-probs, π_prox the
trainer's recomputed ones of the same weights), truncated, w_t = min(π_prox/π_behav, C) (C = 2 there); "mask"
(their masked variant, MIS) zeroes the tokens with w_t > C instead. One function serves both: decoupled PPO with
a cap is TIS on top of staleness.

**GSPO** (Zheng et al. 2025, arXiv:2507.18071, eq. 5–7): one ratio per sequence, length-normalised,

    s_i(θ) = exp( 1/|y_i| · Σ_t log(π_θ(y_t)/π_old(y_t)) ),   J = 1/G Σ_i min(s_i·A_i, clip(s_i, 1−ε_l, 1+ε_h)·A_i)

with ε_l = 3e-4, ε_h = 4e-4 in the paper. The trainer computes it per token (GSPO-token, eq. 13–14:
s_{i,t} = sg[s_i]·π_θ(y_t)/sg[π_θ(y_t)], whose value is s_i and whose gradient is s_i·∇log π_θ(y_t)), aggregated
with "seq-mean-token-mean", which equals J and its gradient for a sequence-level advantage
(`gspo_token_ratio`; tests/test_offpolicy.py checks the two gradients against each other).

**Staleness**: a token sampled by weights older than `max_staleness` versions before the trained ones is masked
out (`staleness_mask`); kept tokens are corrected by their own behaviour log-probs, so per-token versions drive
the weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .aggregation import AGGREGATIONS
from .losses import _is_number, ppo_clip_token_loss
from .masked import as_mask, check_shapes, masked_mean, masked_sum

IS_MODES = ("none", "truncate", "mask")
_sg = jax.lax.stop_gradient


def importance_weights(prox_logp, behav_logp, mask, *, cap: float | None = 2.0, mode: str = "truncate"):
    """Per-token importance weights w_t = π_prox(y_t)/π_behav(y_t) [B, T] (no gradient), corrected by `mode`:
    "none" (w as is), "truncate" (min(w, cap): TIS), "mask" (0 where w > cap: MIS). Padding gets 1.

    Returns (w, metrics): is_weight_mean, is_weight_max (before the correction), is_truncated_frac (tokens with
    w > cap, which the correction changed; 0 for "none"), token means over valid tokens."""
    if mode not in IS_MODES:
        raise ValueError(f"importance-sampling mode {mode!r}; valid choices: {', '.join(IS_MODES)}")
    if mode != "none" and (cap is None or (_is_number(cap) and cap <= 0)):
        raise ValueError(f"importance-sampling cap={cap} must be > 0 with mode={mode!r}")
    mask = as_mask(mask, what="importance_weights")
    check_shapes("importance_weights", prox_logp=prox_logp, behav_logp=behav_logp, mask=mask)
    valid = mask > 0
    log_w = jnp.where(valid, _sg(jnp.asarray(prox_logp, jnp.float32)) - _sg(jnp.asarray(behav_logp, jnp.float32)),
                      0.0)
    raw = jnp.exp(log_w)
    over = (raw > cap) & valid if mode != "none" else jnp.zeros_like(valid)
    w = raw if mode == "none" else jnp.minimum(raw, cap) if mode == "truncate" else jnp.where(over, 0.0, raw)
    metrics = {"is_weight_mean": masked_mean(raw, mask),
               "is_weight_max": jnp.max(jnp.where(valid, raw, 0.0)),
               "is_truncated_frac": masked_mean(over.astype(jnp.float32), mask)}
    return w, metrics


def decoupled_policy_loss(logp, prox_logp, behav_logp, advantages, mask, *, clip_low=0.2, clip_high=None,
                          dual_clip=None, is_cap: float | None = None, is_mode: str = "none",
                          agg: str = "token-mean", norm_len=None, denom=None):
    """AReaL's decoupled PPO loss (module docstring), aggregated by `agg`: ℓ_t = w_t · ppo_clip(u_t, A_t) with
    u_t = exp(logp − prox_logp) and w_t from `importance_weights(prox_logp, behav_logp, cap=is_cap, mode=is_mode)`.
    With behav_logp == prox_logp it is `policy_loss(logp, prox_logp, ...)` exactly (w = 1).

    Returns (loss, metrics): clip_frac, ratio_mean (of u) and the importance-weight metrics."""
    mask = as_mask(mask, what="decoupled_policy_loss")
    check_shapes("decoupled_policy_loss", logp=logp, prox_logp=prox_logp, behav_logp=behav_logp,
                 advantages=advantages, mask=mask)
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {agg!r}; valid choices: {', '.join(AGGREGATIONS)}")
    valid = mask > 0
    w, metrics = importance_weights(prox_logp, behav_logp, mask, cap=is_cap, mode=is_mode)
    adv = _sg(jnp.where(valid, jnp.asarray(advantages, jnp.float32), 0.0))
    u = jnp.exp(jnp.where(valid, jnp.asarray(logp, jnp.float32) - _sg(jnp.asarray(prox_logp, jnp.float32)), 0.0))
    tok, clipped, _ = ppo_clip_token_loss(u, adv, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
    loss = AGGREGATIONS[agg](w * tok, mask, norm_len=norm_len, denom=denom)
    metrics.update(clip_frac=masked_mean(clipped.astype(jnp.float32), mask), ratio_mean=masked_mean(_sg(u), mask))
    return loss, metrics


def sequence_log_ratio(logp, old_logp, mask) -> jax.Array:
    """1/|y_i| Σ_t (logp − old_logp) over each row's valid tokens [B]: log s_i of GSPO (0 for an empty row)."""
    mask = as_mask(mask, what="sequence_log_ratio")
    diff = jnp.asarray(logp, jnp.float32) - jnp.asarray(old_logp, jnp.float32)
    return masked_sum(diff, mask, axis=-1) / jnp.maximum(jnp.sum(mask > 0, axis=-1), 1)


def gspo_policy_loss(logp, old_logp, advantages, mask, *, clip_low=3e-4, clip_high=4e-4):
    """GSPO's sequence-level objective, negated (module docstring): mean over sequences of
    max(−s_i·A_i, −clip(s_i, 1−ε_low, 1+ε_high)·A_i), s_i from `sequence_log_ratio` (differentiated through
    logp). `advantages` [B] or [B, T] (then each row's first valid token's: a sequence-level advantage). Rows with
    no valid token do not count.

    Returns (loss, metrics): clip_frac (sequences clipped), seq_ratio_mean."""
    mask = as_mask(mask, what="gspo_policy_loss")
    check_shapes("gspo_policy_loss", logp=logp, old_logp=old_logp, mask=mask)
    adv = jnp.asarray(advantages, jnp.float32)
    if adv.ndim == 2:
        first = jnp.argmax(mask > 0, axis=-1)
        adv = jnp.take_along_axis(adv, first[:, None], axis=-1)[:, 0]
    s = jnp.exp(sequence_log_ratio(logp, _sg(jnp.asarray(old_logp, jnp.float32)), mask))
    rows = (jnp.sum(mask > 0, axis=-1) > 0).astype(jnp.float32)
    seq, clipped, _ = ppo_clip_token_loss(s, _sg(adv), clip_low=clip_low, clip_high=clip_high)
    n = jnp.maximum(jnp.sum(rows), 1.0)
    metrics = {"clip_frac": jnp.sum(clipped * rows) / n, "seq_ratio_mean": jnp.sum(_sg(s) * rows) / n}
    return jnp.sum(seq * rows) / n, metrics


def gspo_token_ratio(logp, seq_ratio) -> jax.Array:
    """GSPO-token's per-token ratio s_{i,t} = sg[s_i]·exp(logp − sg[logp]) [B, T]: value s_i, gradient
    s_i·∇logp. `seq_ratio` [B, T]: each token's sequence ratio s_i (computed from the current and old log-probs
    beforehand, a constant here)."""
    logp = jnp.asarray(logp, jnp.float32)
    return _sg(jnp.asarray(seq_ratio, jnp.float32)) * jnp.exp(logp - _sg(logp))


def packed_sequence_ratio(logp, old_logp, segment_ids, mask) -> jax.Array:
    """GSPO's s_i for packed rows [R, L] (several sequences per row, `segment_ids` 1.. per row, 0 = padding),
    broadcast to each of the sequence's tokens [R, L] (1 where no token counts): the `seq_ratio` the trainer's
    per-token GSPO form reads. The same as `sequence_log_ratio` on each sequence alone."""
    mask = as_mask(mask, what="packed_sequence_ratio")
    R, L = mask.shape
    idx = (jnp.arange(R)[:, None] * (L + 1) + jnp.asarray(segment_ids)).reshape(-1)
    diff = jnp.where(mask > 0, jnp.asarray(logp, jnp.float32) - jnp.asarray(old_logp, jnp.float32), 0.0)
    sums = jax.ops.segment_sum(diff.reshape(-1), idx, num_segments=R * (L + 1))
    counts = jax.ops.segment_sum((mask > 0).reshape(-1).astype(jnp.float32), idx, num_segments=R * (L + 1))
    return jnp.exp(sums / jnp.maximum(counts, 1.0))[idx].reshape(R, L)


def staleness_mask(token_versions, trained_version, max_staleness: int, mask=None) -> jax.Array:
    """1.0 where a token's weights version is at most `max_staleness` versions older than `trained_version`, else
    0.0 [B, T] (times `mask` when given): the tokens a bounded-staleness trainer keeps."""
    if not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(f"max_staleness={max_staleness} must be an int >= 0")
    keep = (trained_version - jnp.asarray(token_versions)) <= max_staleness
    keep = keep.astype(jnp.float32)
    return keep if mask is None else keep * as_mask(mask, what="staleness_mask")
