"""Layer functions shared by the train forward, prefill and decode paths.

Each function takes explicit arrays and dimensions, not the whole config (STYLE 5); numerics follow
the HF reference implementations (RMSNorm and RoPE tables in float32, cast back to the activation
dtype) so float32 logits match `transformers` to ~1e-5.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from .config import RopeScaling
from .lora import LoraLinear


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm: w * x / sqrt(mean(x^2) + eps), the statistic in float32."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * y.astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """Inverse RoPE frequencies [head_dim/2] (float32), with Llama-3 scaling when given.

    Llama-3 scaling (HF `_compute_llama3_parameters`): wavelengths longer than
    original_max/low_freq_factor are divided by `factor`, shorter than original_max/high_freq_factor
    are kept, and the band between is interpolated smoothly.
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq) -> jax.Array:
    """Rotate-half RoPE. x [B, T, N, D], positions [B, T] (int) -> [B, T, N, D]."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def dense(x: jax.Array, w: jax.Array, n_in: int = 1) -> jax.Array:
    """Contract x's last `n_in` axes with w's first `n_in` axes as one 2-D matmul.

    x [..., *in] and w [*in, *out] -> [..., *out]. The activations are flattened to [tokens, features]
    and the weight to [features_in, features_out] (both free reshapes of row-major arrays), so the
    forward, the input gradient (dy @ wᵀ) and the weight gradient (xᵀ @ dy) are plain GEMMs. The same
    contraction written as a 3-D einsum ("bte,ehd->bthd") made XLA:CPU materialise the weight
    gradient's operand transposed, through a slow strided loop fusion: at the 58M shape (2624 tokens)
    the decoder stack's forward+backward took 3.97 s as einsums and 3.16 s as 2-D matmuls
    (`scripts/bench_train.py`, README "Throughput").

    A `models.lora.LoraLinear` w adds its low-rank path: x W + s · (x A) B (PEFT's order), never forming A B.
    """
    if isinstance(w, LoraLinear):
        return dense(x, w.w, n_in) + w.scale * dense(dense(x, w.lora_a, n_in), w.lora_b)
    lead, w_in, w_out = x.shape[:x.ndim - n_in], w.shape[:n_in], w.shape[n_in:]
    if x.shape[x.ndim - n_in:] != w_in:
        raise ValueError(f"dense: x {x.shape} last {n_in} axes must equal w {w.shape} first {n_in}")
    k = math.prod(w_in)
    y = x.reshape(-1, k) @ w.reshape(k, -1)
    return y.reshape(*lead, *w_out)


def project_qkv(x, *, wq, wk, wv, bq=None, bk=None, bv=None, q_norm=None, k_norm=None, eps: float,
                positions, inv_freq):
    """Normalised hidden [B, T, E] -> (q [B,T,H,D], k [B,T,K,D], v [B,T,K,D]) with bias, q/k-norm and RoPE."""
    q, k, v = dense(x, wq), dense(x, wk), dense(x, wv)
    if bq is not None:
        q, k, v = q + bq, k + bk, v + bv
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def attn_output(o: jax.Array, wo: jax.Array) -> jax.Array:
    """[B, T, H, D] x [H, D, E] -> [B, T, E]."""
    return dense(o, wo, 2)


def swiglu_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """down(silu(gate(x)) * up(x))."""
    return dense(jax.nn.silu(dense(x, w_gate)) * dense(x, w_up), w_down)
