"""Attention with GQA, query offsets, ragged key lengths, causal/sliding-window and segment masks.

`attention(q, k, v, *, q_offset, kv_lengths, causal, window, q_segment_ids, kv_segment_ids, scale,
implementation, interpret, block_sizes)` is the single entry point the model calls. Queries sit at
positions `q_offset + [0, T)` inside the key sequence of length S, so offset 0 with T == S is training
attention and a positive offset is chunked or prefix-shared prefill (and MetroRLHF's block over cached
history, whose gradient must reach the cached keys and values).

Two implementations:
  "xla"    plain jnp with float32 scores, the default and the CPU runtime path: `attention_chunked`, which
           runs the queries in chunks of `BlockSizes.block_q_xla` rows and gives each chunk only the key
           range its causal/window bounds can reach (static slices when `q_offset` is a Python int), so
           the fully masked part of the score matrix is never computed; its numbers are
           `attention_reference`'s (the oracle: every key of every row, masked), up to float rounding.
  "pallas" A flash-attention kernel (FlashAttention-2 online softmax over key blocks, one program per
           (query block, batch, query head)). Backward: two Pallas kernels, in `kernels/attention_bwd.py`,
           recomputing probabilities from the saved per-query logsumexp (never the [T, S] matrix); dK/dV
           come for every key, history before `q_offset` included.
The kernels are written for the Pallas Triton (GPU) lowering: `pl.program_id`, ref slicing with `pl.ds`,
blocks kept in bounds by padding, `lax.div` for index arithmetic. In this repository's CI they only run
with `interpret=True` on the CPU; `tests/test_attention_kernel.py` also lowers them to Triton IR for
CUDA (`jax.export`), and tests/test_cuda_export.py at every shape the engine and trainer make, which checks the
Pallas->Triton lowering but not Triton's own compile, nor speed.

Shapes: q [B, T, H, D]; k, v [B, S, K, D] with H % K == 0 (GQA: query head h reads kv head h // (H/K)).
Masking rules (all combined with AND):
  causal:        key position s <= query position q_offset + t
  window=W:      q_offset + t - s < W  (the W most recent keys, the query's own included; HF semantics)
  kv_lengths:    s < kv_lengths[b]
  segment ids:   q_segment_ids[b, t] == kv_segment_ids[b, s]  (packed sequences)
A query row with no visible key returns zeros (not NaN) and passes no gradient.

Simplified / left for later (said here, not pretended done): the block sizes are untuned defaults;
each query head of a GQA group streams its kv head's blocks separately (L2 serves the repeats; folding
the group into the query block would read K/V once); only the causal/window/kv_lengths bounds skip key
blocks, so blocks excluded by segment ids alone are computed and masked; T, S and D are padded with
`jnp.pad` in the wrapper (a copy when they are not block multiples) rather than handled with masked
loads; float32 dots take Pallas-Triton's default precision on GPU (TF32), full precision when
interpreted.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels.attention_bwd import backward
from kernels.attention_common import (MASK_VALUE, StaticArgs, block_mask, check_shapes, compiler_params,
                                      cpu_upcast, dot, key_block_range, pad_inputs)

IMPLEMENTATIONS = ("xla", "pallas")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (powers of two, >= 16 for Triton's dot) for the forward and the two backward kernels, and
    the query chunk of the "xla" implementation.

    A tile longer than the (power-of-two rounded) sequence is shrunk to it, so short decode-like calls
    do not pad T up to a full block.
    """

    block_q: int = 64
    block_k: int = 64
    block_q_dkv: int = 64
    block_k_dkv: int = 64
    block_q_dq: int = 64
    block_k_dq: int = 64
    block_q_xla: int = 128   # query rows per chunk of the "xla" implementation (`attention_chunked`)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            b = getattr(self, f.name)
            if not isinstance(b, int) or b < 16 or b & (b - 1):
                raise ValueError(f"BlockSizes.{f.name}={b!r}: want a power of two >= 16 ({self})")


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
    check_shapes(q, k, v)
    B, T, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    qg = q.reshape(B, T, K, H // K, D)
    s = jnp.einsum("btkgd,bskd->bkgts", *cpu_upcast(qg, k), preferred_element_type=jnp.float32) * scale
    mask = attention_mask(T, S, q_offset=q_offset, kv_lengths=kv_lengths, causal=causal, window=window,
                          q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, batch=B)
    s = jnp.where(mask[:, None, None], s, MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1) * jnp.any(mask, axis=-1)[:, None, None, :, None]
    o = jnp.einsum("bkgts,bskd->btkgd", *cpu_upcast(p.astype(v.dtype), v), preferred_element_type=jnp.float32)
    return o.reshape(B, T, H, D).astype(q.dtype)


def attention_chunked(q, k, v, *, q_offset=0, kv_lengths=None, causal=True, window=None,
                      q_segment_ids=None, kv_segment_ids=None, scale: float | None = None,
                      block_q: int = 128) -> jax.Array:
    """`attention_reference` computed `block_q` query rows at a time, each chunk over only the keys it can see.

    With a static `q_offset` (a Python int), the chunk of queries [t0, t1) sits at positions
    q_offset + [t0, t1): causal attention reaches keys < q_offset + t1, a window W keys >= q_offset + t0 - W + 1.
    The chunk's keys (and key segment ids) are sliced to that range and the reference runs on the slice
    with its offset and kv_lengths shifted by the slice start, so every visible key is included and no
    fully masked column block is computed: for causal training rows of length S, about (S/block_q + 1) /
    (2 S/block_q) of the square (0.56 at S = 1024, block_q = 128). Measured at the 58M shape, 8 x 1024
    tokens, decoder stack forward+backward: 21.0 s (full square) -> 12.7 s (README "Throughput").
    Autodiff through the slices gives dK/dV for every key, history included. A per-row (array) q_offset
    has no static bound: the whole key range is used (the reference, chunked by queries only).
    """
    T, S = q.shape[1], k.shape[1]
    if T <= block_q:
        return attention_reference(q, k, v, q_offset=q_offset, kv_lengths=kv_lengths, causal=causal,
                                   window=window, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                                   scale=scale)
    static = isinstance(q_offset, int)
    outs = []
    for t0 in range(0, T, block_q):
        t1 = min(T, t0 + block_q)
        lo, hi = 0, S
        if static and causal:
            hi = max(0, min(S, q_offset + t1))
        if static and window is not None:
            lo = min(S, max(0, q_offset + t0 - window + 1))
        if hi <= lo:     # no key visible to any query of the chunk: zeros, as the reference gives
            outs.append(jnp.zeros((q.shape[0], t1 - t0, *q.shape[2:]), q.dtype))
            continue
        off = q_offset - lo + t0 if static else jnp.asarray(q_offset, jnp.int32) + t0
        outs.append(attention_reference(
            q[:, t0:t1], k[:, lo:hi], v[:, lo:hi], q_offset=off, causal=causal, window=window,
            kv_lengths=None if kv_lengths is None else jnp.asarray(kv_lengths, jnp.int32) - lo,
            q_segment_ids=None if q_segment_ids is None else q_segment_ids[:, t0:t1],
            kv_segment_ids=None if kv_segment_ids is None else kv_segment_ids[:, lo:hi], scale=scale))
    return jnp.concatenate(outs, axis=1)


# ----------------------------------------------------------------------------------------------------
# Forward kernel: grid (query blocks, B, H); K/V of the head's kv group stay in HBM and are streamed.


def _fwd_kernel(offset_ref, kv_len_ref, q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, o_ref, lse_ref, *,
                st: StaticArgs):
    bq, bk = st.block_q, st.block_k
    iq, b = pl.program_id(0), pl.program_id(1)
    offset, kv_len = offset_ref[b], kv_len_ref[b]
    q = q_ref[...]                                               # [bq, Dp]
    q_first = offset + iq * bq
    q_pos = q_first + jnp.arange(bq, dtype=jnp.int32)
    q_seg = None if q_seg_ref is None else q_seg_ref[...]

    def body(j, carry):
        o, m, l = carry
        ks = pl.ds(j * bk, bk)
        kv_seg = None if kv_seg_ref is None else kv_seg_ref[ks]
        mask = block_mask(q_pos, j * bk + jnp.arange(bk, dtype=jnp.int32), kv_len, q_seg, kv_seg, st)
        s = jnp.where(mask, dot(q, k_ref[ks, :], trans_b=True) * st.scale, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)   # masked -> exactly 0, even in empty rows
        corr = jnp.exp(m - m_new)
        v = v_ref[ks, :]
        return corr[:, None] * o + dot(p.astype(v.dtype), v), m_new, corr * l + jnp.sum(p, axis=1)

    lo, hi = key_block_range(q_first, q_first + bq - 1, kv_len, bk, st)
    init = (jnp.zeros(q.shape, jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32))
    o, m, l = lax.fori_loop(lo, hi, body, init)
    seen = l > 0.0
    o_ref[...] = (o * jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)


def _forward(q, k, v, offset, kv_len, q_seg, kv_seg, st: StaticArgs):
    """Returns o [B, T, H, D] and lse [B, H, T_pad] (float32, natural log; -inf for rows with no key)."""
    B, T, H, D = q.shape
    K = k.shape[2]
    G = H // K
    q, k, v, q_seg, kv_seg = pad_inputs(q, k, v, q_seg, kv_seg, st)
    Tp, Sp, Dp, bq = st.T_pad, st.S_pad, st.D_pad, st.block_q
    whole = pl.BlockSpec((B,), lambda i, b, h: (0,))
    kv_spec = pl.BlockSpec((None, Sp, None, Dp), lambda i, b, h: (b, 0, lax.div(h, G), 0))
    seg_specs = [None, None] if q_seg is None else [pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
                                                    pl.BlockSpec((None, Sp), lambda i, b, h: (b, 0))]
    o, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, st=st),
        grid=(Tp // bq, B, H),
        in_specs=[whole, whole, pl.BlockSpec((None, bq, None, Dp), lambda i, b, h: (b, i, h, 0)),
                  kv_spec, kv_spec, *seg_specs],
        out_specs=[pl.BlockSpec((None, bq, None, Dp), lambda i, b, h: (b, i, h, 0)),
                   pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))],
        out_shape=[jax.ShapeDtypeStruct((B, Tp, H, Dp), q.dtype), jax.ShapeDtypeStruct((B, H, Tp), jnp.float32)],
        compiler_params=compiler_params(num_warps=4 if Dp <= 64 else 8),
        interpret=st.interpret,
        name="flash_attention_fwd",
    )(offset, kv_len, q, k, v, q_seg, kv_seg)
    return o[:, :T, :, :D], lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _flash(q, k, v, offset, kv_len, q_seg, kv_seg, st):
    return _forward(q, k, v, offset, kv_len, q_seg, kv_seg, st)[0]


def _flash_fwd(q, k, v, offset, kv_len, q_seg, kv_seg, st):
    o, lse = _forward(q, k, v, offset, kv_len, q_seg, kv_seg, st)
    return o, (q, k, v, offset, kv_len, q_seg, kv_seg, o, lse)


def _flash_bwd(st, res, do):
    dq, dk, dv = backward(res, do, st)
    return dq, dk, dv, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ----------------------------------------------------------------------------------------------------
# Entry point.


def _check_args(q, k, q_offset, kv_lengths, window, q_segment_ids, kv_segment_ids, implementation, block_sizes):
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation={implementation!r}; valid: {IMPLEMENTATIONS}")
    if jnp.ndim(q_offset) not in (0, 1) or (jnp.ndim(q_offset) == 1 and jnp.shape(q_offset) != (B,)):
        raise ValueError(f"q_offset must be an int or shape ({B},); got shape {jnp.shape(q_offset)} for q{q.shape}")
    if kv_lengths is not None and jnp.shape(kv_lengths) != (B,):
        raise ValueError(f"kv_lengths must have shape ({B},); got {jnp.shape(kv_lengths)} for k{k.shape}")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int or None; got {window!r}")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("pass both q_segment_ids and kv_segment_ids, or neither")
    if q_segment_ids is not None and (q_segment_ids.shape != (B, T) or kv_segment_ids.shape != (B, S)):
        raise ValueError(f"segment ids want q ({B}, {T}) and kv ({B}, {S}); got {q_segment_ids.shape} and "
                         f"{kv_segment_ids.shape} for q{q.shape} k{k.shape}")
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"block_sizes must be a BlockSizes; got {type(block_sizes).__name__}")


def attention(q, k, v, *, q_offset=0, kv_lengths=None, causal=True, window=None,
              q_segment_ids=None, kv_segment_ids=None, scale: float | None = None,
              implementation: str = "xla", interpret: bool | None = None,
              block_sizes: BlockSizes | None = None) -> jax.Array:
    """Attention of q [B, T, H, D] over k, v [B, S, K, D]; returns [B, T, H, D] in q's dtype.

    q_offset: int or int [B], position of query 0 inside the keys. kv_lengths: int [B] or None.
    implementation: "xla" (default: `attention_chunked`, the reference's math over query chunks that skip
    fully masked keys) or "pallas" (flash kernel with a custom VJP; dK/dV cover all keys). interpret: run
    the Pallas kernel in interpret mode; None means "when the default backend is the CPU". block_sizes:
    tile sizes (default `BlockSizes()`; "xla" reads `block_q_xla`).
    """
    check_shapes(q, k, v)
    _check_args(q, k, q_offset, kv_lengths, window, q_segment_ids, kv_segment_ids, implementation, block_sizes)
    kwargs = dict(q_offset=q_offset, kv_lengths=kv_lengths, causal=causal, window=window,
                  q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, scale=scale)
    if implementation == "xla":
        return attention_chunked(q, k, v, **kwargs, block_q=(block_sizes or BlockSizes()).block_q_xla)
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"pallas attention wants one dtype for q, k, v; got {q.dtype}, {k.dtype}, {v.dtype}")
    interpret = jax.default_backend() == "cpu" if interpret is None else interpret
    if not interpret and jax.default_backend() != "gpu":
        raise ValueError(f"pallas attention is a GPU (Triton) kernel; backend is {jax.default_backend()!r}: "
                         "pass interpret=True or implementation='xla'")
    B, T, H, D = q.shape
    S = k.shape[1]
    bs = block_sizes or BlockSizes()
    fit_q = lambda b: min(b, max(16, pl.next_power_of_2(T)))  # noqa: E731
    fit_k = lambda b: min(b, max(16, pl.next_power_of_2(S)))  # noqa: E731
    st = StaticArgs(causal=bool(causal), window=window, scale=float(D ** -0.5 if scale is None else scale),
                    interpret=bool(interpret), T=T, S=S, D=D,
                    block_q=fit_q(bs.block_q), block_k=fit_k(bs.block_k), block_q_dkv=fit_q(bs.block_q_dkv),
                    block_k_dkv=fit_k(bs.block_k_dkv), block_q_dq=fit_q(bs.block_q_dq),
                    block_k_dq=fit_k(bs.block_k_dq))
    offset = jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32), (B,))
    kv_len = jnp.full((B,), S, jnp.int32) if kv_lengths is None else jnp.minimum(jnp.asarray(kv_lengths, jnp.int32), S)
    if q_segment_ids is not None:
        q_segment_ids, kv_segment_ids = q_segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32)
    return _flash(q, k, v, offset, kv_len, q_segment_ids, kv_segment_ids, st)
