"""Forward passes over the one decoder layer (`decoder_layer`): `decoder_stack` (the layer, scanned),
`forward` (training), `forward_block` (a block of tokens against given history K/V).

The decoder layer (norm -> q/k/v -> attend -> wo -> residual -> norm -> SwiGLU -> residual) is written once,
in `decoder_layer`, which `decoder_stack` scans. What differs between the train forward, the block forward and
the rollout's prefill/decode steps is only how a layer's queries meet keys and values, so each caller passes
an `attend` hook: the train forward attends within the block (segment masks for packed rows), the block
forward attends over [history; block], and `jaxrl.rollout.model_step` writes the paged KV cache and attends
over it (its pages travel as the scan `carry`). Nothing is threaded through a mode string.

Rematerialisation (`remat`, see `REMAT_POLICIES`) wraps the scan body in `jax.checkpoint`:
  "none"   save every residual the backward needs (fastest, most memory: per layer, the attention
           probabilities [B, H, T, S] with the XLA attention, and every MLP activation).
  "layer"  save only each layer's input; the backward recomputes the layer (one extra forward).
  "dots"   save matmul outputs without batch dimensions (the q/k/v/o and MLP projections) and recompute
           the rest (norms, RoPE, attention scores, activations): `dots_with_no_batch_dims_saveable`.
`prevent_cse=False` because the body runs under `lax.scan`, which already keeps XLA from merging the
recomputation into the forward (JAX's advice for checkpoint inside scan).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from kernels import attention
from kernels.attention import cpu_upcast

from . import layers as L
from .config import ModelConfig
from .weights import Weights

REMAT_POLICIES = ("none", "layer", "dots")
ATTENTION_IMPLS = ("xla", "pallas")

# attend(l, q, k, v, carry, xs_l) -> (o [B,T,H,D], carry, ys_l)
Attend = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, Any, Any], tuple[jax.Array, Any, Any]]


def lm_head(weights: Weights) -> jax.Array:
    """The output projection [embed, vocab] (the transposed embedding when tied); `vocab` is the weights'
    (possibly padded) row count, so callers mask or slice columns >= `cfg.vocab_size`."""
    return weights.embed.T if weights.lm_head is None else weights.lm_head


def inv_freq(cfg: ModelConfig):
    return L.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r}; valid choices: {', '.join(choices)}")


def _remat(body, remat: str):
    _check_choice("remat", remat, REMAT_POLICIES)
    if remat == "none":
        return body
    policy = None if remat == "layer" else jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    return jax.checkpoint(body, policy=policy, prevent_cse=False)


def decoder_layer(layer, cfg: ModelConfig, x: jax.Array, positions: jax.Array, attend: Attend, l, carry=None,
                  xs_l=None, *, freqs=None):
    """One decoder layer (`layer`: one layer's weights, a `Layers` without the leading layer axis) on x [B,T,E]
    -> (x, carry, ys_l); `attend` as in `decoder_stack`, called with layer index `l`. `decoder_stack` scans it."""
    freqs = inv_freq(cfg) if freqs is None else freqs
    with jax.named_scope("decoder_layer"):
        h = L.rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
        q, k, v = L.project_qkv(h, wq=layer.wq, wk=layer.wk, wv=layer.wv, bq=layer.bq, bk=layer.bk,
                                bv=layer.bv, q_norm=layer.q_norm, k_norm=layer.k_norm, eps=cfg.rms_norm_eps,
                                positions=positions, inv_freq=freqs)
        o, carry, ys_l = attend(l, q, k, v, carry, xs_l)
        x = x + L.attn_output(o, layer.wo)
        h = L.rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)
        x = x + L.swiglu_mlp(h, layer.w_gate, layer.w_up, layer.w_down)
    return x, carry, ys_l


def decoder_stack(weights: Weights, cfg: ModelConfig, x: jax.Array, positions: jax.Array, attend: Attend, *,
                  carry=None, xs=None, remat: str = "none"):
    """Embedded input x [B,T,E] -> (final-normed hidden [B,T,E], carry, ys).

    Runs every layer under `lax.scan`; in each layer, after the q/k/v projection (+bias, q/k-norm, RoPE
    at `positions` [B,T]), calls `attend(l, q, k, v, carry, xs_l) -> (o [B,T,H,D], carry, ys_l)`, where
    l is the layer index (a traced int32), xs_l is layer l's slice of the optional per-layer inputs `xs`
    (a pytree with a leading layer axis, or None) and ys_l (any pytree, or None) is stacked over layers
    into `ys`. Then the output projection, residual, and the SwiGLU MLP with its residual.
    `remat` is one of `REMAT_POLICIES` (module docstring).
    """
    freqs = inv_freq(cfg)

    def body(c, inp):
        x, carry = c
        layer, l, xs_l = inp
        x, carry, ys_l = decoder_layer(layer, cfg, x, positions, attend, l, carry, xs_l, freqs=freqs)
        return (x, carry), ys_l

    (x, carry), ys = jax.lax.scan(_remat(body, remat), (x, carry),
                                  (weights.layers, jnp.arange(cfg.num_layers, dtype=jnp.int32), xs))
    return L.rms_norm(x, weights.final_norm, cfg.rms_norm_eps), carry, ys


def _head(weights: Weights, cfg: ModelConfig, x: jax.Array, return_hidden: bool) -> jax.Array:
    """Hidden states, or float32 logits over the real vocabulary (padded columns, if any, sliced off)."""
    if return_hidden:
        return x
    logits = jnp.einsum("bte,ev->btv", *cpu_upcast(x, lm_head(weights)), preferred_element_type=jnp.float32)
    return logits[..., :cfg.vocab_size] if logits.shape[-1] != cfg.vocab_size else logits


@functools.partial(jax.jit, static_argnames=("cfg", "return_hidden", "attention_impl", "remat"))
def forward(weights: Weights, cfg: ModelConfig, tokens: jax.Array, *, positions: jax.Array | None = None,
            segment_ids: jax.Array | None = None, return_hidden: bool = False, attention_impl: str = "xla",
            remat: str = "none") -> jax.Array:
    """Causal LM forward.

    tokens [B, T] int32. positions [B, T] default 0..T-1 (give per-segment positions for packed
    rows). segment_ids [B, T]: tokens attend only within their own segment (packing); default: one
    segment per row. Returns float32 logits [B, T, cfg.vocab_size] (the real vocabulary, also when the
    weights carry padded rows: `models.weights.padded_vocab`), or the final-normed hidden states
    [B, T, embed] (weights' dtype) with `return_hidden=True` — training computes log-probs from these
    in vocabulary chunks instead of materialising logits. attention_impl: "xla" or "pallas"
    (`kernels.attention`; interpret mode on the CPU). remat: one of `REMAT_POLICIES`.
    """
    _check_choice("attention_impl", attention_impl, ATTENTION_IMPLS)
    _check_choice("remat", remat, REMAT_POLICIES)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq]; got shape {tokens.shape}")
    B, T = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    if positions.shape != tokens.shape or (segment_ids is not None and segment_ids.shape != tokens.shape):
        raise ValueError(f"positions/segment_ids must match tokens {tokens.shape}")

    def attend(l, q, k, v, carry, xs_l):
        o = attention(q, k, v, causal=True, window=cfg.sliding_window, q_segment_ids=segment_ids,
                      kv_segment_ids=segment_ids, implementation=attention_impl)
        return o, carry, None

    x, _, _ = decoder_stack(weights, cfg, weights.embed[tokens], positions, attend, remat=remat)
    return _head(weights, cfg, x, return_hidden)


@functools.partial(jax.jit, static_argnames=("cfg", "return_hidden", "attention_impl", "remat"))
def forward_block(weights: Weights, cfg: ModelConfig, tokens: jax.Array, history_k: jax.Array,
                  history_v: jax.Array, *, positions: jax.Array | None = None, return_hidden: bool = False,
                  attention_impl: str = "xla", remat: str = "none"):
    """A block of T tokens per row against given history K/V per layer (MetroRLHF's trapezoid block).

    tokens [B, T] int32. history_k/history_v [L, B, S, K, D] (S may be 0): the keys/values of the S
    positions before the block, as the rollout KV cache or an earlier block produced them (post-RoPE
    keys, post-k-norm). Queries sit at q_offset=S inside the key sequence [history; block]; RoPE at
    absolute positions `positions` [B, T] (default S..S+T-1). Every row's history has the same length S
    (no padding mask). Returns (float32 logits [B, T, cfg.vocab_size] (the real vocabulary, as `forward`),
    or the final-normed hidden states with
    `return_hidden=True`; (k_block, v_block) each [L, B, T, K, D] in the activation dtype), so the next
    block can use concat(history, block) along S as its history. Differentiable w.r.t. the weights and
    the history (the attention VJP returns dK/dV for every key, history included). remat: one of
    `REMAT_POLICIES`, as in `forward`.
    """
    _check_choice("attention_impl", attention_impl, ATTENTION_IMPLS)
    _check_choice("remat", remat, REMAT_POLICIES)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq]; got shape {tokens.shape}")
    B, T = tokens.shape
    want = (cfg.num_layers, B, history_k.shape[2] if history_k.ndim == 5 else -1, cfg.num_kv_heads, cfg.head_dim)
    if history_k.ndim != 5 or history_k.shape != want or history_v.shape != history_k.shape:
        raise ValueError(f"history_k/history_v must be [layers, batch, S, kv_heads, head_dim] = "
                         f"[{cfg.num_layers}, {B}, S, {cfg.num_kv_heads}, {cfg.head_dim}]; "
                         f"got {history_k.shape} and {history_v.shape}")
    S = history_k.shape[2]
    if positions is None:
        positions = jnp.broadcast_to(S + jnp.arange(T, dtype=jnp.int32), (B, T))
    if positions.shape != tokens.shape:
        raise ValueError(f"positions {positions.shape} must match tokens {tokens.shape}")

    def attend(l, q, k, v, carry, hist):
        hk, hv = hist
        kk = jnp.concatenate([hk.astype(k.dtype), k], axis=1)
        vv = jnp.concatenate([hv.astype(v.dtype), v], axis=1)
        o = attention(q, kk, vv, q_offset=S, causal=True, window=cfg.sliding_window, implementation=attention_impl)
        return o, carry, (k, v)

    x, _, kv = decoder_stack(weights, cfg, weights.embed[tokens], positions, attend, xs=(history_k, history_v),
                              remat=remat)
    return _head(weights, cfg, x, return_hidden), kv
