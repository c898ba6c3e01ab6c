"""Policy, KL, entropy and value losses: pure functions of per-token arrays [B, T].

    pg, m = policy_loss(logp, old_logp, adv, mask, clip_low=0.2, clip_high=0.28, agg="token-mean")
    loss = pg + beta * kl_loss(logp, ref_logp, mask, kind="k3") - ent_coef * entropy_bonus(ent, mask)
    vf, vm = value_loss(values, old_values, returns, mask, clip=0.2)

All inputs are [B, T] float arrays of the *sampled* tokens (log-probs, advantages, values), plus the
response mask. `old_logp`, `ref_logp`, `old_values`, `returns` and `advantages` are constants of the
step: gradients are stopped through them here so a caller cannot differentiate them by accident.
Losses are to be minimised. Every scalar goes through one aggregation mode from `AGGREGATIONS`
(see `aggregation.py`); metrics are plain token means over valid tokens, whatever the mode.

Off-policy corrections (decoupled PPO, truncated importance sampling, GSPO's sequence-level ratio, a staleness
mask) are in `offpolicy.py`. Left out on purpose: a log-ratio clamp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .aggregation import AGGREGATIONS, aggregate
from .kl import KL_ESTIMATORS, kl_k3, kl_penalty
from .masked import as_mask, check_shapes, masked_mean

__all__ = ["AGGREGATIONS", "KL_ESTIMATORS", "aggregate", "entropy_bonus", "kl_loss", "kl_penalty",
           "policy_loss", "ppo_clip_token_loss", "value_loss", "value_token_loss"]

_sg = jax.lax.stop_gradient


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def ppo_clip_token_loss(ratio, advantages, *, clip_low=0.2, clip_high=None, dual_clip=None):
    """Per-token clipped surrogate, negated to a loss.

    PPO (Schulman et al. 2017, arXiv:1707.06347, eq. 7):
        ℓ_t = −min(ρ_t·A_t, clip(ρ_t, 1−ε_low, 1+ε_high)·A_t) = max(−ρ_t·A_t, −clip(ρ_t, …)·A_t)
    with ε_high = ε_low unless set (DAPO "Clip-Higher", Yu et al. 2025, arXiv:2503.14476, §3.1,
    e.g. ε_low = 0.2, ε_high = 0.28). Dual-clip (Ye et al. 2020, "Mastering Complex Control in MOBA
    Games", arXiv:1912.09729): for A_t < 0 the loss is also capped, ℓ_t ← min(ℓ_t, −c·A_t) =
    min(ℓ_t, c·|A_t|), c > 1, so a huge ratio on a bad token cannot blow up the update.

    ratio, advantages [B, T] -> (loss [B, T], clipped [B, T] bool, dual_clipped [B, T] bool), where
    `clipped` marks tokens whose clip branch is active (zero gradient from the PPO clip) and
    `dual_clipped` those held at the dual-clip cap (zero gradient too).
    """
    clip_high = clip_low if clip_high is None else clip_high
    unclipped = -advantages * ratio
    clipped_loss = -advantages * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = jnp.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
    if dual_clip is None:
        return loss, clipped, jnp.zeros_like(clipped)
    cap = -dual_clip * advantages
    dual = (advantages < 0) & (loss > cap)
    return jnp.where(dual, cap, loss), clipped, dual


def policy_loss(logp, old_logp, advantages, mask, *, clip_low=0.2, clip_high=None, dual_clip=None,
                agg: str = "token-mean", norm_len=None, denom=None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped policy-gradient loss (PPO / DAPO clip-higher / dual-clip), aggregated by `agg`.

    ρ_t = exp(logp_t − old_logp_t); per-token loss from `ppo_clip_token_loss`; reduced with
    `AGGREGATIONS[agg]` ("token-mean" for DAPO, "seq-mean-token-mean" for the original GRPO,
    "seq-mean-token-sum-norm" with `norm_len` for Dr. GRPO).

    logp: [B, T] log π_θ of the sampled tokens (differentiated); old_logp: [B, T] log π_old (the
    rollout policy); advantages: [B, T]; mask: [B, T]. clip_low = ε_low, clip_high = ε_high
    (None → ε_low), dual_clip = c > 1 or None.

    Returns (loss scalar, metrics) with metrics (token means over valid tokens, no gradient):
    clip_frac, clip_frac_low (ρ < 1−ε_low, A < 0), clip_frac_high (ρ > 1+ε_high, A > 0),
    dual_clip_frac, approx_kl (k3 estimate of KL(π_old ‖ π_θ) on the rollout samples), ratio_mean.
    """
    mask = as_mask(mask, what="policy_loss")
    check_shapes("policy_loss", logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {agg!r}; valid choices: {', '.join(AGGREGATIONS)}")
    if _is_number(clip_low) and not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low={clip_low} must be in [0, 1)")
    if _is_number(clip_high) and clip_high < 0.0:
        raise ValueError(f"clip_high={clip_high} must be >= 0")
    if _is_number(dual_clip) and dual_clip <= 1.0:
        raise ValueError(f"dual_clip={dual_clip} must be > 1 (typically 3)")

    valid = mask > 0
    logp = jnp.asarray(logp, jnp.float32)
    old_logp = _sg(jnp.asarray(old_logp, jnp.float32))
    adv = _sg(jnp.where(valid, jnp.asarray(advantages, jnp.float32), 0.0))
    # Padding never reaches exp(): no overflow and no NaN gradient from garbage log-probs there.
    log_ratio = jnp.where(valid, logp - old_logp, 0.0)
    ratio = jnp.exp(log_ratio)

    tok_loss, clipped, dual = ppo_clip_token_loss(ratio, adv, clip_low=clip_low, clip_high=clip_high,
                                                  dual_clip=dual_clip)
    loss = AGGREGATIONS[agg](tok_loss, mask, norm_len=norm_len, denom=denom)

    r, lr = _sg(ratio), _sg(log_ratio)
    f32 = lambda b: b.astype(jnp.float32)
    metrics = {
        "clip_frac": masked_mean(f32(clipped), mask),
        "clip_frac_low": masked_mean(f32(clipped & (r < 1.0)), mask),
        "clip_frac_high": masked_mean(f32(clipped & (r > 1.0)), mask),
        "dual_clip_frac": masked_mean(f32(dual), mask),
        "approx_kl": masked_mean(kl_k3(jnp.zeros_like(lr), lr), mask),   # k3 of KL(π_old‖π_θ)
        "ratio_mean": masked_mean(r, mask),
    }
    return loss, metrics


def kl_loss(logp, ref_logp, mask, kind: str = "k3", agg: str = "token-mean", *, norm_len=None,
            denom=None) -> jax.Array:
    """KL(π_θ ‖ π_ref) as a loss term, β·D_KL in GRPO's objective (DeepSeekMath, arXiv:2402.03300,
    eq. 3 with the k3 estimator of eq. 4), aggregated with the same mode as the policy loss.

    logp [B, T] (differentiated), ref_logp [B, T] (no gradient), mask [B, T] -> scalar.
    Gradient note: d k3/d logp = 1 − π_ref/π_θ, whose expectation is not ∇KL; k2's gradient is the
    one that matches ∇KL(π_θ ‖ π_ref) on-policy. k3 is the default because GRPO recipes use it.
    """
    mask = as_mask(mask, what="kl_loss")
    per_tok = kl_penalty(logp, _sg(jnp.asarray(ref_logp, jnp.float32)), kind, mask=mask)
    return aggregate(per_tok, mask, agg, norm_len=norm_len, denom=denom)


def entropy_bonus(entropy, mask, agg: str = "token-mean", *, norm_len=None, denom=None) -> jax.Array:
    """Aggregated policy entropy H, the bonus of PPO's objective L^CLIP − c₁·L^VF + c₂·S[π_θ]
    (Schulman et al. 2017, eq. 9). Returned as +H: subtract `coef · entropy_bonus(...)` from the loss.

    entropy [B, T] (per-position entropy of π_θ, e.g. from the chunked log-prob kernel); mask [B, T].
    """
    return aggregate(entropy, mask, agg, norm_len=norm_len, denom=denom)


def value_token_loss(values, old_values, returns, *, clip=0.2):
    """Per-token squared value error [B, T] before the ½ and the aggregation: max((V − R)², (clip(V, V_old − ε,
    V_old + ε) − R)²), or (V − R)² with `clip=None`; and where the clipped term is the larger (bool [B, T]).
    old_values and returns are constants (gradients stopped)."""
    v = jnp.asarray(values, jnp.float32)
    old_v = _sg(jnp.asarray(old_values, jnp.float32))
    ret = _sg(jnp.asarray(returns, jnp.float32))
    unclipped = jnp.square(v - ret)
    if clip is None:
        return unclipped, jnp.zeros(v.shape, bool)
    clipped_sq = jnp.square(jnp.clip(v, old_v - clip, old_v + clip) - ret)
    return jnp.maximum(unclipped, clipped_sq), clipped_sq > unclipped


def value_loss(values, old_values, returns, mask, clip=0.2, agg: str = "token-mean", *, norm_len=None,
               denom=None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO critic loss with value clipping: ½·max((V − R)², (clip(V, V_old − ε, V_old + ε) − R)²).

    The clipped term is PPO's value-function trust region from OpenAI baselines `ppo2` (studied in
    Engstrom et al. 2020, arXiv:2005.12729, §3, "value function clipping"); `clip=None` gives the
    plain ½(V − R)² of PPO eq. 9's L^VF.

    values [B, T] (critic, differentiated); old_values [B, T] (critic at rollout time); returns [B, T]
    (e.g. from `gae_advantages`); mask [B, T]. Returns (loss scalar, metrics: vf_clip_frac — tokens
    where the clipped term is the larger, value_mean).
    """
    mask = as_mask(mask, what="value_loss")
    check_shapes("value_loss", values=values, old_values=old_values, returns=returns, mask=mask)
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {agg!r}; valid choices: {', '.join(AGGREGATIONS)}")
    if _is_number(clip) and clip < 0:
        raise ValueError(f"value clip={clip} must be >= 0 (or None for no clipping)")
    v = jnp.asarray(values, jnp.float32)
    tok, clipped = value_token_loss(v, old_values, returns, clip=clip)
    loss = 0.5 * AGGREGATIONS[agg](tok, mask, norm_len=norm_len, denom=denom)
    metrics = {"vf_clip_frac": masked_mean(clipped.astype(jnp.float32), mask),
               "value_mean": masked_mean(_sg(v), mask)}
    return loss, metrics
