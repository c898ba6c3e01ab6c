"""Attention with GQA, query offsets, ragged key lengths, causal/sliding-window and segment masks.

`attention(q, k, v, *, q_offset, kv_lengths, causal, window, q_segment_ids, kv_segment_ids)` is the
single entry point the model calls. Queries sit at positions `q_offset + [0, T)` inside the key
sequence of length S, so offset 0 with T == S is training attention and a positive offset is chunked
or prefix-shared prefill (and, later, MetroRLHF's block over cached history).

This module currently holds only the pure-jnp `attention_reference` and dispatches to it. The Pallas
kernel (with `interpret=True` on the CPU and a custom VJP returning dk, dv for all keys) arrives with
the rollout-engine work; its tests will compare against this reference.

Shapes: q [B, T, H, D]; k, v [B, S, K, D] with H % K == 0 (GQA: query head h reads kv head h // (H/K)).
Masking rules (all combined with AND):
  causal:        key position s <= query position q_offset + t
  window=W:      q_offset + t - s < W  (the W most recent keys, the query's own included; HF semantics)
  kv_lengths:    s < kv_lengths[b]
  segment ids:   q_segment_ids[b, t] == kv_segment_ids[b, s]  (packed sequences)
A query row with no visible key returns zeros (not NaN).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _check_shapes(q, k, v):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"attention wants q [B,T,H,D], k/v [B,S,K,D]; got q{q.shape} k{k.shape} v{v.shape}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"attention shape mismatch: q{q.shape} k{k.shape} v{v.shape}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} not a multiple of kv heads {k.shape[2]}: q{q.shape} k{k.shape}")


def attention_mask(T: int, S: int, *, q_offset=0, kv_lengths=None, causal=True, window=None,
                   q_segment_ids=None, kv_segment_ids=None, batch: int = 1) -> jax.Array:
    """Boolean [B, T, S] mask of which keys each query may attend to (see module docstring)."""
    q_pos = jnp.asarray(q_offset, jnp.int32).reshape(-1, 1) + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B|1, T]
    k_pos = jnp.arange(S, dtype=jnp.int32)
    mask = jnp.ones((batch, T, S), bool)
    if causal:
        mask &= k_pos[None, None, :] <= q_pos[:, :, None]
    if window is not None:
        mask &= q_pos[:, :, None] - k_pos[None, None, :] < window
    if kv_lengths is not None:
        mask &= k_pos[None, None, :] < jnp.asarray(kv_lengths, jnp.int32).reshape(-1, 1, 1)
    if q_segment_ids is not None or kv_segment_ids is not None:
        if q_segment_ids is None or kv_segment_ids is None:
            raise ValueError("pass both q_segment_ids and kv_segment_ids, or neither")
        mask &= q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    return mask


def attention_reference(q, k, v, *, q_offset=0, kv_lengths=None, causal=True, window=None,
                        q_segment_ids=None, kv_segment_ids=None, scale: float | None = None) -> jax.Array:
    """Plain-jnp attention (scores in float32); returns [B, T, H, D] in q's dtype."""
    _check_shapes(q, k, v)
    B, T, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    qg = q.reshape(B, T, K, H // K, D)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    mask = attention_mask(T, S, q_offset=q_offset, kv_lengths=kv_lengths, causal=causal, window=window,
                          q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, batch=B)
    s = jnp.where(mask[:, None, None], s, _MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1) * jnp.any(mask, axis=-1)[:, None, None, :, None]
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(B, T, H, D).astype(q.dtype)


def attention(q, k, v, *, q_offset=0, kv_lengths=None, causal=True, window=None,
              q_segment_ids=None, kv_segment_ids=None, scale: float | None = None) -> jax.Array:
    """Attention entry point used by the model (currently the XLA reference path; see module doc)."""
    return attention_reference(q, k, v, q_offset=q_offset, kv_lengths=kv_lengths, causal=causal, window=window,
                               q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, scale=scale)
