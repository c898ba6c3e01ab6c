"""Loss aggregation modes: per-token values [B, T] -> one scalar, in a registry by name.

Every mode takes `(x [B, T], mask [B, T], *, norm_len=None, denom=None)`:

* `denom` overrides the final mean's denominator — the number of valid tokens for "token-mean",
  the number of sequences for the "seq-mean-*" modes. When one batch is split into micro-batches
  (gradient accumulation, the stream trainer), pass the *whole* batch's count to each micro-batch
  so that the micro-batch losses sum to the full-batch loss exactly.
* by default the number of sequences counts rows with at least one valid token, so all-padding
  rows of a bucketed batch do not dilute the mean.
* `norm_len` is the constant length normaliser of "seq-mean-token-sum-norm" (default: T).

The names follow verl's `loss_agg_mode`, so recipes read the same.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from .masked import as_mask, check_shapes, masked_sum
from .registry import lookup, registrar

AGGREGATIONS: dict[str, Callable] = {}


register_aggregation = registrar(AGGREGATIONS, "aggregation")


def aggregate(x, mask, agg: str = "token-mean", *, norm_len=None, denom=None) -> jax.Array:
    """Reduce per-token values x [B, T] over valid tokens with the mode `agg` (see AGGREGATIONS)."""
    fn = lookup(AGGREGATIONS, agg, "aggregation")
    mask = as_mask(mask, what=f"aggregate({agg})")
    check_shapes(f"aggregate({agg})", x=x, mask=mask)
    return fn(jnp.asarray(x, jnp.float32), mask, norm_len=norm_len, denom=denom)


def _num_seqs(mask, denom):
    return jnp.maximum(jnp.sum(jnp.any(mask > 0, axis=-1)), 1) if denom is None else denom


@register_aggregation("token-mean")
def token_mean(x, mask, *, norm_len=None, denom=None):
    """Σ_i Σ_t ℓ_i,t / Σ_i |o_i| — every token of the batch weighs the same
    (DAPO, Yu et al. 2025, arXiv:2503.14476, §3.3 "Token-Level Policy Gradient Loss")."""
    n = jnp.maximum(jnp.sum(mask > 0), 1) if denom is None else denom
    return masked_sum(x, mask) / n


@register_aggregation("seq-mean-token-mean")
def seq_mean_token_mean(x, mask, *, norm_len=None, denom=None):
    """1/G Σ_i 1/|o_i| Σ_t ℓ_i,t — each sequence weighs the same
    (GRPO, Shao et al. 2024, arXiv:2402.03300, eq. 3)."""
    per_seq = masked_sum(x, mask, axis=-1) / jnp.maximum(jnp.sum(mask > 0, axis=-1), 1)
    return jnp.sum(per_seq) / _num_seqs(mask, denom)


@register_aggregation("seq-mean-token-sum")
def seq_mean_token_sum(x, mask, *, norm_len=None, denom=None):
    """1/G Σ_i Σ_t ℓ_i,t — the per-sequence REINFORCE sum of token terms, averaged over sequences."""
    return masked_sum(x, mask) / _num_seqs(mask, denom)


@register_aggregation("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(x, mask, *, norm_len=None, denom=None):
    """1/G Σ_i Σ_t ℓ_i,t / L with a constant L (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783, §3.1:
    the 1/|o_i| length normaliser is replaced by the generation budget, removing the length bias).

    L = `norm_len`, default T (pass the configured max_new_tokens so that L does not change with
    the padded bucket). verl's mode of the same name omits the 1/G; the two differ by a constant.
    """
    L = mask.shape[-1] if norm_len is None else norm_len
    return masked_sum(x, mask) / (_num_seqs(mask, denom) * L)
