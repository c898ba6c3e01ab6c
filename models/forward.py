"""Train-style forward pass: tokens -> logits (or final hidden states), layers under `lax.scan`.

Prefill and decode (rollout) are separate functions built from the same layer functions in
`models.layers`; nothing here is threaded through a mode string.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels import attention

from . import layers as L
from .config import ModelConfig
from .weights import Weights


def lm_head(weights: Weights) -> jax.Array:
    """The output projection [embed, vocab] (the transposed embedding when tied)."""
    return weights.embed.T if weights.lm_head is None else weights.lm_head


def inv_freq(cfg: ModelConfig):
    return L.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)


def decoder_layer(x, layer, *, cfg: ModelConfig, positions, segment_ids, freqs):
    """One pre-norm decoder block over a whole (packed) sequence. `layer` is one slice of `Layers`."""
    h = L.rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
    q, k, v = L.project_qkv(h, wq=layer.wq, wk=layer.wk, wv=layer.wv, bq=layer.bq, bk=layer.bk, bv=layer.bv,
                            q_norm=layer.q_norm, k_norm=layer.k_norm, eps=cfg.rms_norm_eps,
                            positions=positions, inv_freq=freqs)
    o = attention(q, k, v, causal=True, q_segment_ids=segment_ids, kv_segment_ids=segment_ids)
    x = x + L.attn_output(o, layer.wo)
    h = L.rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)
    return x + L.swiglu_mlp(h, layer.w_gate, layer.w_up, layer.w_down)


@functools.partial(jax.jit, static_argnames=("cfg", "return_hidden"))
def forward(weights: Weights, cfg: ModelConfig, tokens: jax.Array, *, positions: jax.Array | None = None,
            segment_ids: jax.Array | None = None, return_hidden: bool = False) -> jax.Array:
    """Causal LM forward.

    tokens [B, T] int32. positions [B, T] default 0..T-1 (give per-segment positions for packed
    rows). segment_ids [B, T]: tokens attend only within their own segment (packing); default: one
    segment per row. Returns float32 logits [B, T, vocab], or the final-normed hidden states
    [B, T, embed] (weights' dtype) with `return_hidden=True` — training computes log-probs from these
    in vocabulary chunks instead of materialising logits.
    """
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq]; got shape {tokens.shape}")
    B, T = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    if positions.shape != tokens.shape or (segment_ids is not None and segment_ids.shape != tokens.shape):
        raise ValueError(f"positions/segment_ids must match tokens {tokens.shape}")
    freqs = inv_freq(cfg)
    x = weights.embed[tokens]

    def body(x, layer):
        with jax.named_scope("decoder_layer"):
            return decoder_layer(x, layer, cfg=cfg, positions=positions, segment_ids=segment_ids, freqs=freqs), None

    x, _ = jax.lax.scan(body, x, weights.layers)
    x = L.rms_norm(x, weights.final_norm, cfg.rms_norm_eps)
    if return_hidden:
        return x
    return jnp.einsum("bte,ev->btv", x, lm_head(weights), preferred_element_type=jnp.float32)
