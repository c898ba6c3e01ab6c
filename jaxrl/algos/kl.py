"""Per-token KL estimators between the policy and a reference model, in a registry by name.

Tokens are sampled from the policy π_θ (or its rollout copy), so each estimator estimates
KL(π_θ ‖ π_ref) from one sample per position (Schulman 2020, "Approximating KL Divergence",
http://joschu.net/blog/kl-approx.html). With d = log π_ref − log π_θ, r = e^d:

* k1 = −d                  unbiased, high variance, can be negative
* k2 = ½ d²                biased, low variance, ≥ 0
* k3 = (r − 1) − d         unbiased, low variance, ≥ 0 (GRPO's choice, DeepSeekMath eq. 4)

Use them either as a reward penalty (`outcome_token_rewards(..., kl=kl_penalty(...))`, PPO /
REINFORCE++ style, usually k1) or as a loss term (`kl_loss`, GRPO style, usually k3).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from .masked import check_shapes
from .registry import lookup, registrar

KL_ESTIMATORS: dict[str, Callable] = {}


register_kl_estimator = registrar(KL_ESTIMATORS, "KL estimator")   # fn(logp, ref_logp) -> per-token KL


@register_kl_estimator("k1")
def kl_k1(logp, ref_logp):
    """k1 = log π_θ − log π_ref (Schulman 2020)."""
    return logp - ref_logp


@register_kl_estimator("k2")
def kl_k2(logp, ref_logp):
    """k2 = ½ (log π_θ − log π_ref)² (Schulman 2020)."""
    return 0.5 * jnp.square(logp - ref_logp)


@register_kl_estimator("k3")
def kl_k3(logp, ref_logp):
    """k3 = π_ref/π_θ − log(π_ref/π_θ) − 1 (Schulman 2020; DeepSeekMath, arXiv:2402.03300, eq. 4).

    Computed as expm1(d) − d, d = ref_logp − logp, which keeps precision when d ≈ 0.
    """
    d = ref_logp - logp
    return jnp.expm1(d) - d


def kl_penalty(logp, ref_logp, kind: str = "k3", *, mask=None) -> jax.Array:
    """Per-token KL estimate [B, T] of KL(π_θ ‖ π_ref) with estimator `kind` ("k1", "k2", "k3").

    logp, ref_logp [B, T]: log-probs of the sampled tokens under the policy and the reference.
    With `mask`, padding positions are 0 and never reach the estimator (no overflow from garbage
    log-probs in padding, and no NaN gradient through it).
    """
    fn = lookup(KL_ESTIMATORS, kind, "KL estimator")
    check_shapes(f"kl_penalty({kind})", logp=logp, ref_logp=ref_logp)
    logp = jnp.asarray(logp, jnp.float32)
    ref_logp = jnp.asarray(ref_logp, jnp.float32)
    if mask is None:
        return fn(logp, ref_logp)
    check_shapes(f"kl_penalty({kind})", logp=logp, mask=mask)
    valid = jnp.asarray(mask) > 0
    out = fn(jnp.where(valid, logp, 0.0), jnp.where(valid, ref_logp, 0.0))
    return jnp.where(valid, out, 0.0)
