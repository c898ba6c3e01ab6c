"""XLA flash attention for a *traced* query offset that skips the (query chunk, key chunk) pairs no query sees.

`attention_chunked` (kernels/attention.py) bounds each query chunk's keys with static slices, which needs
the offset as a Python int. MetroRLHF's block step (jaxrl/train/blockwise.py) compiles once for every
block, so its queries sit at a traced offset iT inside a fixed P-key buffer: the chunked path must give
every query chunk all P keys (masked), about twice the causal work summed over a row's blocks, and
autodiff keeps every [T, P] probability tile for the backward. Here the attention runs as (query chunk ×
key chunk) pairs, each in `lax.cond` on whether any query of the chunk can see any key of it (causal: the
chunk's first key <= its last query position; window W: its last key > its first query position - W;
kv_lengths; the extreme offsets over the batch rows decide), so an invisible pair costs a branch, not
matmuls. Pairs merge with the online softmax (running max m, normaliser l, unnormalised output, float32).
A custom VJP (FlashAttention-2's backward) saves only the output and each query's log-sum-exp and
recomputes the visible pairs' probabilities: dV = Pᵀ dO, dS = P ∘ (dO Vᵀ - rowsum(dO ∘ O)), dQ = dS K,
dK = dSᵀ Q (scaled), an outer scan over key chunks and an inner one over query chunks. A query with no
visible key returns zeros and passes no gradient, as `attention_reference` (the oracle,
tests/test_attention_pairs.py; analytic zeros of dS come out as rounding, not bitwise zeros).

Measured (the block step of scripts/bench_blockwise.py's small model, one row of 8192 tokens, T = 4096,
CPU): block at 0 / at 4096: 14.3 / 19.1 s attending the whole masked buffer -> 5.9 / 9.8 s; the residual
traffic of the masked [T, P] tiles was most of the time, not the matmuls.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from .attention import attention_mask
from .attention_common import MASK_VALUE, check_shapes, cpu_upcast


def _skip(qc, *_):
    B, Tq, K, G, D = qc.shape
    return (jnp.zeros((B, Tq, K, G, D), jnp.float32), jnp.full((B, K, G, Tq), MASK_VALUE, jnp.float32),
            jnp.zeros((B, K, G, Tq), jnp.float32))


def _merge(a, b):
    (oa, ma, la), (ob, mb, lb) = a, b
    m = jnp.maximum(ma, mb)
    ca, cb = jnp.exp(ma - m), jnp.exp(mb - m)
    t = lambda c: jnp.moveaxis(c, 3, 1)[..., None]      # noqa: E731  [B, K, G, Tq] -> [B, Tq, K, G, 1]
    return oa * t(ca) + ob * t(cb), m, la * ca + lb * cb


@dataclasses.dataclass(frozen=True)
class _Static:
    B: int
    T: int
    S: int
    K: int
    G: int
    D: int
    bq: int
    bk: int
    causal: bool
    window: int | None
    scale: float
    segs: bool

    @property
    def nq(self) -> int:
        return -(-self.T // self.bq)

    @property
    def nk(self) -> int:
        return -(-self.S // self.bk)


def _seen(st: _Static, t0, s0, first, last, longest):
    """Can any query of the chunk at t0 see any key of the chunk at s0 (any row)?"""
    seen = s0 < longest
    if st.causal:
        seen &= s0 <= last + t0 + st.bq - 1
    if st.window is not None:
        seen &= s0 + st.bk - 1 > first + t0 - st.window
    return seen


def _mask(st: _Static, q_off, kv_len, qseg, kseg):
    return attention_mask(st.bq, st.bk, q_offset=q_off, kv_lengths=kv_len, causal=st.causal, window=st.window,
                          q_segment_ids=qseg if st.segs else None, kv_segment_ids=kseg if st.segs else None,
                          batch=st.B)[:, None, None]


def _forward(st: _Static, qs, ks, vs, off, kv_len, qsegs, ksegs):
    """Outputs [nq, B, bq, K, G, D] (float32) and log-sum-exps [nq, B, K, G, bq] of every query chunk."""
    first, last, longest = jnp.min(off), jnp.max(off), jnp.max(kv_len)

    def per_query_chunk(_, xs):
        qc, qseg, t0 = xs

        def pair(qc, kc, vc, q_off, kl, qseg, kseg):
            s = jnp.einsum("btkgd,bskd->bkgts", *cpu_upcast(qc, kc), preferred_element_type=jnp.float32) * st.scale
            mask = _mask(st, q_off, kl, qseg, kseg)
            s = jnp.where(mask, s, MASK_VALUE)
            m = jnp.max(s, axis=-1)
            p = jnp.exp(s - m[..., None]) * mask
            o = jnp.einsum("bkgts,bskd->btkgd", *cpu_upcast(p.astype(vc.dtype), vc), preferred_element_type=jnp.float32)
            return o, m, jnp.sum(p, axis=-1)

        def per_key_chunk(acc, ys):
            kc, vc, kseg, s0 = ys
            part = lax.cond(_seen(st, t0, s0, first, last, longest), pair, lambda qc, *_: _skip(qc), qc, kc, vc,
                            off + t0 - s0, kv_len - s0, qseg, kseg)
            return _merge(acc, part), None

        (o, m, l), _ = lax.scan(per_key_chunk, _skip(qc), (ks, vs, ksegs, jnp.arange(st.nk, dtype=jnp.int32) * st.bk))
        lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), 0.0)
        lt = jnp.moveaxis(l, 3, 1)[..., None]
        return None, (jnp.where(lt > 0, o / jnp.where(lt > 0, lt, 1.0), 0.0), lse)

    _, (o, lse) = lax.scan(per_query_chunk, None, (qs, qsegs, jnp.arange(st.nq, dtype=jnp.int32) * st.bq))
    return o, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st: _Static, qs, ks, vs, off, kv_len, qsegs, ksegs):
    return _forward(st, qs, ks, vs, off, kv_len, qsegs, ksegs)[0].astype(qs.dtype)


def _flash_fwd(st, qs, ks, vs, off, kv_len, qsegs, ksegs):
    o, lse = _forward(st, qs, ks, vs, off, kv_len, qsegs, ksegs)
    o = o.astype(qs.dtype)
    return o, (qs, ks, vs, off, kv_len, qsegs, ksegs, o, lse)


def _flash_bwd(st, res, do):
    """FlashAttention-2's backward over the visible pairs: probabilities recomputed from the saved
    log-sum-exp; outer scan over key chunks (dK, dV of the chunk), inner over query chunks (dQ summed)."""
    qs, ks, vs, off, kv_len, qsegs, ksegs, o, lse = res
    first, last, longest = jnp.min(off), jnp.max(off), jnp.max(kv_len)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    delta = jnp.moveaxis(jnp.sum(f32(do) * f32(o), axis=-1), 2, -1)          # [nq, B, K, G, bq]
    t0s = jnp.arange(st.nq, dtype=jnp.int32) * st.bq

    def per_key_chunk(dq, xs):
        kc, vc, kseg, s0 = xs

        def pair(qc, doc, lse_c, delta_c, q_off, kl, qseg, kseg):
            qf, kf, vf, dof = f32(qc), f32(kc), f32(vc), f32(doc)
            s = jnp.einsum("btkgd,bskd->bkgts", qf, kf) * st.scale
            mask = _mask(st, q_off, kl, qseg, kseg)
            p = jnp.exp(jnp.where(mask, s, MASK_VALUE) - lse_c[..., None]) * mask
            dv = jnp.einsum("bkgts,btkgd->bskd", p, dof)
            ds = p * (jnp.einsum("btkgd,bskd->bkgts", dof, vf) - delta_c[..., None])
            return (jnp.einsum("bkgts,btkgd->bskd", ds, qf) * st.scale, dv,
                    jnp.einsum("bkgts,bskd->btkgd", ds, kf) * st.scale)

        def skip(qc, *_):
            z = jnp.zeros((st.B, st.bk, st.K, st.D), jnp.float32)
            return z, z, jnp.zeros(qc.shape, jnp.float32)

        def per_query_chunk(acc, ys):
            qc, doc, lse_c, delta_c, qseg, t0 = ys
            dk, dv, dq_c = lax.cond(_seen(st, t0, s0, first, last, longest), pair, skip, qc, doc, lse_c, delta_c,
                                    off + t0 - s0, kv_len - s0, qseg, kseg)
            return (acc[0] + dk, acc[1] + dv), dq_c

        z = jnp.zeros((st.B, st.bk, st.K, st.D), jnp.float32)
        (dk, dv), dq_parts = lax.scan(per_query_chunk, (z, z), (qs, do, lse, delta, qsegs, t0s))
        return dq + dq_parts, (dk, dv)

    dq, (dk, dv) = lax.scan(per_key_chunk, jnp.zeros(qs.shape, jnp.float32),
                            (ks, vs, ksegs, jnp.arange(st.nk, dtype=jnp.int32) * st.bk))
    return dq.astype(qs.dtype), dk.astype(ks.dtype), dv.astype(vs.dtype), None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def attention_pairs(q, k, v, *, q_offset, kv_lengths=None, causal: bool = True, window: int | None = None,
                    q_segment_ids=None, kv_segment_ids=None, scale: float | None = None, block_q: int = 512,
                    block_k: int = 512) -> jax.Array:
    """Attention of q [B, T, H, D] at `q_offset` (int, or a traced scalar or [B]) over k, v [B, S, K, D], with
    the masks of `kernels.attention` (kv_lengths int [B] or None); returns [B, T, H, D] in q's dtype. Pairs
    of `block_q` queries × `block_k` keys that no query can see are skipped at run time (module docstring).

    Queries and keys are padded to whole chunks (padded keys masked by length, padded queries dropped) and
    walked by nested `lax.scan`s; a custom VJP keeps only the output and each query's log-sum-exp and
    recomputes the probabilities of the visible pairs in the backward (FlashAttention-2's scheme)."""
    check_shapes(q, k, v)
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("pass both q_segment_ids and kv_segment_ids, or neither")
    B, T, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    st = _Static(B=B, T=T, S=S, K=K, G=H // K, D=D, bq=min(block_q, T), bk=min(block_k, S), causal=bool(causal),
                 window=window, scale=float(D ** -0.5 if scale is None else scale), segs=q_segment_ids is not None)
    off = jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32).reshape(-1), (B,))
    kv_len = jnp.full((B,), S, jnp.int32) if kv_lengths is None else jnp.minimum(
        jnp.broadcast_to(jnp.asarray(kv_lengths, jnp.int32), (B,)), S)
    pad = lambda x, n: jnp.pad(x, [(0, n - x.shape[1]) if a == 1 else (0, 0) for a in range(x.ndim)])  # noqa: E731
    chunks = lambda x, n, b: jnp.moveaxis(pad(x, n * b).reshape(B, n, b, *x.shape[2:]), 1, 0)  # noqa: E731
    qs = chunks(q, st.nq, st.bq).reshape(st.nq, B, st.bq, K, st.G, D)
    ks, vs = chunks(k, st.nk, st.bk), chunks(v, st.nk, st.bk)
    if st.segs:
        qsegs, ksegs = chunks(q_segment_ids.astype(jnp.int32), st.nq, st.bq), chunks(
            kv_segment_ids.astype(jnp.int32), st.nk, st.bk)
    else:
        qsegs, ksegs = jnp.zeros((st.nq,), jnp.int32), jnp.zeros((st.nk,), jnp.int32)
    out = _flash(st, qs, ks, vs, off, kv_len, qsegs, ksegs)
    return jnp.moveaxis(out, 0, 1).reshape(B, st.nq * st.bq, H, D)[:, :T]
