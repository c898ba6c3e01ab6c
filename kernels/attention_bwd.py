"""Backward of the Pallas flash attention in `kernels/attention.py`: two Pallas kernels (FlashAttention-2).

Residuals are q, k, v, the output o and the per-query logsumexp (float32 [B, H, T_pad]); probabilities
are recomputed block by block as exp(s - lse), never stored. With delta = rowsum(o * do) (a cheap jnp
reduction here rather than a third kernel):
  dP = dO V^T,  dS = P * (dP - delta),  dQ = scale * dS K,  dK = scale * dS^T Q,  dV = P^T dO.

  dq kernel    grid (query blocks, B, H): streams the key blocks the query block can see.
  dk/dv kernel grid (key blocks, B, K):   streams every query head of the kv head's GQA group and every
               query block that can see the key block, accumulating in registers, so no two programs
               write the same dK/dV tile (no atomics) and no per-query-head dK/dV is materialised.
dK and dV are produced for every key position, including history keys before `q_offset` (chunked
prefill, MetroRLHF's block over cached K/V), and are exactly zero for keys no query sees.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels.attention_common import (StaticArgs, block_mask, compiler_params, dot, key_block_range, pad_axis,
                                      pad_inputs)


def _probs(q, k, q_pos, k_pos, kv_len, q_seg, kv_seg, lse, st: StaticArgs):
    """Recomputed softmax probabilities [bq, bk]; masked entries (and rows with no key) are 0."""
    mask = block_mask(q_pos, k_pos, kv_len, q_seg, kv_seg, st)
    return jnp.where(mask, jnp.exp(dot(q, k, trans_b=True) * st.scale - lse[:, None]), 0.0)


def _dq_kernel(offset_ref, kv_len_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, kv_seg_ref,
               dq_ref, *, st: StaticArgs):
    bq, bk = st.block_q_dq, st.block_k_dq
    iq, b = pl.program_id(0), pl.program_id(1)
    offset, kv_len = offset_ref[b], kv_len_ref[b]
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    q_first = offset + iq * bq
    q_pos = q_first + jnp.arange(bq, dtype=jnp.int32)
    q_seg = None if q_seg_ref is None else q_seg_ref[...]

    def body(j, dq):
        ks = pl.ds(j * bk, bk)
        k, v = k_ref[ks, :], v_ref[ks, :]
        kv_seg = None if kv_seg_ref is None else kv_seg_ref[ks]
        p = _probs(q, k, q_pos, j * bk + jnp.arange(bk, dtype=jnp.int32), kv_len, q_seg, kv_seg, lse, st)
        ds = p * (dot(do, v, trans_b=True) - delta[:, None])
        return dq + dot(ds.astype(k.dtype), k)

    lo, hi = key_block_range(q_first, q_first + bq - 1, kv_len, bk, st)
    dq = lax.fori_loop(lo, hi, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * st.scale).astype(dq_ref.dtype)


def _dkdv_kernel(offset_ref, kv_len_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, kv_seg_ref,
                 dk_ref, dv_ref, *, st: StaticArgs, groups: int):
    bq, bk = st.block_q_dkv, st.block_k_dkv
    jk, b = pl.program_id(0), pl.program_id(1)
    offset, kv_len = offset_ref[b], kv_len_ref[b]
    k, v = k_ref[...], v_ref[...]                                 # [bk, Dp]
    k_first = jk * bk
    k_pos = k_first + jnp.arange(bk, dtype=jnp.int32)
    kv_seg = None if kv_seg_ref is None else kv_seg_ref[...]

    # Query blocks that can see this key block: causal needs q_pos >= k_first, the window needs
    # q_pos < k_last + window; blocks past the real T (padding) and key blocks past kv_len see nothing.
    n_real = -(-st.T // bq)
    lo = lax.div(jnp.maximum(k_first - offset, 0), bq) if st.causal else jnp.int32(0)
    hi = jnp.int32(n_real)
    if st.window is not None:
        hi = jnp.minimum(hi, lax.div(jnp.maximum(k_first + bk - 1 + st.window - offset, 0) + bq - 1, bq))
    n = jnp.where(k_first < kv_len, jnp.maximum(hi - lo, 0), 0)

    def body(idx, carry):                   # idx runs over (group member g, query block iq) pairs
        dk, dv = carry
        g = lax.div(idx, n)
        iq = lo + idx - g * n
        qs = pl.ds(iq * bq, bq)
        q, do = q_ref[qs, g, :], do_ref[qs, g, :]
        lse, delta = lse_ref[g, qs], delta_ref[g, qs]
        q_seg = None if q_seg_ref is None else q_seg_ref[qs]
        q_pos = offset + iq * bq + jnp.arange(bq, dtype=jnp.int32)
        p = _probs(q, k, q_pos, k_pos, kv_len, q_seg, kv_seg, lse, st)
        dv = dv + dot(p.astype(do.dtype), do, trans_a=True)
        ds = p * (dot(do, v, trans_b=True) - delta[:, None])
        return dk + dot(ds.astype(q.dtype), q, trans_a=True), dv

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, groups * n, body, (zeros, zeros))
    dk_ref[...] = (dk * st.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def backward(res, do, st: StaticArgs):
    """(dq, dk, dv) for the flash forward's residuals `res` and output cotangent `do` [B, T, H, D]."""
    q, k, v, offset, kv_len, q_seg, kv_seg, o, lse = res
    B, T, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    G = H // K
    Tp, Sp, Dp = st.T_pad, st.S_pad, st.D_pad
    do = do.astype(q.dtype)
    delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))
    delta = pad_axis(delta, 2, Tp)
    do = pad_axis(pad_axis(do, 1, Tp), 3, Dp)
    q, k, v, q_seg, kv_seg = pad_inputs(q, k, v, q_seg, kv_seg, st)
    whole = pl.BlockSpec((B,), lambda *_: (0,))
    name = lambda s: f"flash_attention_bwd_{s}"  # noqa: E731

    bq = st.block_q_dq
    q_spec = pl.BlockSpec((None, bq, None, Dp), lambda i, b, h: (b, i, h, 0))
    kv_spec = pl.BlockSpec((None, Sp, None, Dp), lambda i, b, h: (b, 0, lax.div(h, G), 0))
    row_spec = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
    seg_specs = [None, None] if q_seg is None else [pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
                                                    pl.BlockSpec((None, Sp), lambda i, b, h: (b, 0))]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, st=st),
        grid=(Tp // bq, B, H),
        in_specs=[whole, whole, q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, *seg_specs],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=compiler_params(num_warps=4 if Dp <= 64 else 8),
        interpret=st.interpret,
        name=name("dq"),
    )(offset, kv_len, q, k, v, do, lse, delta, q_seg, kv_seg)

    bk = st.block_k_dkv
    group_spec = pl.BlockSpec((None, Tp, None, G, Dp), lambda j, b, h: (b, 0, h, 0, 0))
    kv_spec = pl.BlockSpec((None, bk, None, Dp), lambda j, b, h: (b, j, h, 0))
    rows_spec = pl.BlockSpec((None, None, G, Tp), lambda j, b, h: (b, h, 0, 0))
    seg_specs = [None, None] if q_seg is None else [pl.BlockSpec((None, Tp), lambda j, b, h: (b, 0)),
                                                    pl.BlockSpec((None, bk), lambda j, b, h: (b, j))]
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, st=st, groups=G),
        grid=(Sp // bk, B, K),
        in_specs=[whole, whole, group_spec, kv_spec, kv_spec, group_spec, rows_spec, rows_spec, *seg_specs],
        out_specs=[kv_spec, kv_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=compiler_params(num_warps=4 if Dp <= 64 else 8),
        interpret=st.interpret,
        name=name("dkdv"),
    )(offset, kv_len, q.reshape(B, Tp, K, G, Dp), k, v, do.reshape(B, Tp, K, G, Dp),
      lse.reshape(B, K, G, Tp), delta.reshape(B, K, G, Tp), q_seg, kv_seg)
    return dq[:, :T, :, :D], dk[:, :S, :, :D], dv[:, :S, :, :D]
