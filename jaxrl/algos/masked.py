"""Masked statistics over [B, T] token arrays, shared by advantages and losses.

Conventions for the whole `jaxrl.algos` package:

* `B` is the number of sequences, `T` the padded response length; `mask [B, T]` is 1 on response
  tokens that count (bool, int or float; cast to float32 here) and 0 on padding. Masks may be
  non-contiguous (e.g. tool-output tokens masked out inside a response).
* Every reduction reads padding positions through `jnp.where(mask, x, 0)`, never `x * mask`, so a
  NaN or inf in a padding slot does not leak into the result.
* Counts used as denominators are clamped to >= 1, so an all-padding batch gives 0, not NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_shapes(what: str, **arrays) -> None:
    """Raise ValueError naming every array's shape unless all have the same shape."""
    shapes = {k: tuple(jnp.shape(v)) for k, v in arrays.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{k}{list(s)}" for k, s in shapes.items())
        raise ValueError(f"{what}: shapes must match, got {listed}")


def as_mask(mask, *, what: str = "mask") -> jax.Array:
    """A [B, T] response mask as float32; ValueError unless it is 2-D."""
    mask = jnp.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"{what}: mask must be [B, T], got shape {list(mask.shape)}")
    return mask.astype(jnp.float32)


def masked_sum(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
    """Σ x over positions where mask != 0."""
    return jnp.sum(jnp.where(mask > 0, x, 0.0), axis=axis)


def masked_mean(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
    """Σ_valid x / max(#valid, 1)."""
    return masked_sum(x, mask, axis) / jnp.maximum(jnp.sum(mask > 0, axis=axis), 1)


def masked_var(x: jax.Array, mask: jax.Array, *, ddof: int = 0) -> jax.Array:
    """Variance of x over all valid positions, Σ (x - mean)² / max(#valid - ddof, 1)."""
    n = jnp.sum(mask > 0)
    mu = masked_mean(x, mask)
    return masked_sum(jnp.square(x - mu), mask) / jnp.maximum(n - ddof, 1)


def masked_whiten(x: jax.Array, mask: jax.Array, *, shift_mean: bool = True, eps: float = 1e-8) -> jax.Array:
    """(x - mean) / sqrt(var + eps) over all valid positions (population variance, as OpenRLHF's
    REINFORCE++ and the PPO-for-LLM codebases whiten); padding positions are set to 0."""
    mu = masked_mean(x, mask)
    y = (x - mu) if shift_mean else x
    y = y * jax.lax.rsqrt(masked_var(x, mask) + eps)
    return jnp.where(mask > 0, y, 0.0)


def last_token_mask(mask: jax.Array) -> jax.Array:
    """[B, T] float32 one-hot at each row's last valid token (an all-zero row stays all zero)."""
    T = mask.shape[-1]
    valid = mask > 0
    last = T - 1 - jnp.argmax(valid[:, ::-1], axis=-1)                  # [B]
    onehot = jnp.arange(T)[None, :] == last[:, None]
    return (onehot & jnp.any(valid, axis=-1, keepdims=True)).astype(jnp.float32)


def broadcast_sequence(seq: jax.Array, mask: jax.Array) -> jax.Array:
    """Sequence values [B] -> token values [B, T]: seq[b] on valid tokens, 0 on padding."""
    if seq.shape != mask.shape[:1]:
        raise ValueError(f"sequence values [B]={list(seq.shape)} do not match mask [B, T]={list(mask.shape)}")
    return jnp.where(mask > 0, seq[:, None].astype(jnp.float32), 0.0)


def reverse_discounted_sum(x: jax.Array, mask: jax.Array, gamma) -> jax.Array:
    """G_t = x_t + γ·G_{t'} where t' is the next *valid* token after t (0 after the last one).

    Padding positions are skipped (the running sum passes through them unchanged) and return 0,
    so a masked gap inside a response does not cost a discount step.
    """
    def step(carry, xs):
        xt, mt = xs
        g = jnp.where(mt > 0, xt + gamma * carry, carry)
        return g, jnp.where(mt > 0, g, 0.0)

    _, out = jax.lax.scan(step, jnp.zeros(x.shape[:1], jnp.float32), (x.T.astype(jnp.float32), mask.T),
                          reverse=True)
    return out.T
