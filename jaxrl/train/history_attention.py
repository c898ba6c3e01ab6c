"""A block's attention over the cached history whose backward adds the history gradient into ∇C in place
(MetroRLHF's block step, `jaxrl.train.blockwise`).

In one layer of a block step the block's queries attend to keys = [cached history C_l; the block's own
K/V written at `start`]. Written with plain autodiff (`jax.vjp` of the block forward w.r.t. C), JAX keeps
the merged [history; block] K/V of every layer as a residual (a copy of C), returns the history
cotangent as a fresh stacked [L, R, P, K, D] array, and the caller converts and adds it into ∇C: three
buffers the size of C or ∇C on top of C and ∇C themselves (measured in scripts/bench_blockwise.py).

`history_attention` is a custom VJP that avoids all three:
  - its residuals are the block's q, k, v and the layer's *slice* of C (a scan input, which `lax.scan`
    forwards instead of stacking), so the merged buffer is rebuilt in the backward, not stored;
  - ∇C is threaded through the layer scan as a carry that the primal passes through unchanged; its
    cotangent (the caller feeds ∇C itself) flows back through the layers, and layer l's backward adds
    its history gradient into row l of it (a read-modify-write of one row, which XLA does in place).
    The cotangent the vjp returns for ∇C *is* the updated accumulator.
The block's own K/V cotangent from later blocks, ∇C[:, :, block], is sliced by the caller before the vjp
and fed as the cotangent of the block's K/V outputs: read inside the backward, from the carried
accumulator that the same backward updates, it made XLA copy the whole accumulator per layer.

Positions after the block get exactly zero (causal mask) and the block's own positions are not history,
so layer l's addition is the attention's dK/dV with the block's rows zeroed, as with autodiff. The
attention's forward runs again in the backward (`jax.vjp` of the chosen implementation; the flash kernels
keep only o and the log-sum-exp, so this is their forward's cost once more per layer).

`stored_history`: on XLA:CPU a bfloat16 C goes in as its raw bits (see there). Measured at the
qwen3-0.6b shape, 32K tokens, T = 1K (scripts/bench_blockwise.py): the block step's compiled peak went
from 34.91 GiB (autodiff) to 22.75 GiB (ratio to the full step 4.45x -> 6.83x).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kernels import attention
from kernels.attention_pairs import attention_pairs


class Attn(NamedTuple):
    """Static description of the block attention (hashable: a custom_vjp nondiff argument)."""
    impl: str                   # "xla" (kernels.attention_pairs, chunk pairs skipped at run time) or "pallas"
    window: int | None
    pair_block: int


def _attend(a: Attn, q, kk, vv, start, q_seg, kv_seg):
    masks = dict(causal=True, window=a.window, q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    if a.impl == "xla":
        return attention_pairs(q, kk, vv, q_offset=start, **masks, block_q=a.pair_block, block_k=a.pair_block)
    return attention(q, kk, vv, q_offset=jnp.full((q.shape[0],), start, jnp.int32), **masks, implementation=a.impl)


def stored_history(kv):
    """The cache C as the block step takes it. On XLA:CPU a bfloat16 C is kept as its raw bits (uint16,
    `lax.bitcast_convert_type`, no arithmetic), reinterpreted per layer in `_merge`: XLA:CPU has no
    bfloat16 dot, upcasts the attention's K/V operands to float32 and then hoists that conversion through
    the layer slice out of the layer loop, a float32 copy of all of C (2x its size; measured in
    scripts/bench_blockwise.py). Other backends and dtypes: unchanged."""
    if jax.default_backend() != "cpu":
        return kv
    return jax.tree.map(lambda x: lax.bitcast_convert_type(x, jnp.uint16) if x.dtype == jnp.bfloat16 else x, kv)


def _merge(hist, own, start):
    if hist.dtype == jnp.uint16:                        # stored_history's bits
        hist = lax.bitcast_convert_type(hist, jnp.bfloat16)
    return lax.dynamic_update_slice_in_dim(hist.astype(own.dtype), own, start, axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def history_attention(a: Attn, q, k, v, grad_k, grad_v, hist_k, hist_v, layer, start, q_seg, kv_seg):
    """Attention of the block's q [R, T, H, D] over layer `layer`'s history hist_k/hist_v [R, P, K, D] with the
    block's own k, v [R, T, K, D] written at `start`. Returns (o, grad_k, grad_v): the accumulators
    [L, R, P, K, D] pass through; their cotangents are where the history gradient goes (module docstring)."""
    return _attend(a, q, _merge(hist_k, k, start), _merge(hist_v, v, start), start, q_seg, kv_seg), grad_k, grad_v


def _fwd(a, q, k, v, grad_k, grad_v, hist_k, hist_v, layer, start, q_seg, kv_seg):
    out = history_attention(a, q, k, v, grad_k, grad_v, hist_k, hist_v, layer, start, q_seg, kv_seg)
    return out, (q, k, v, hist_k, hist_v, layer, start, q_seg, kv_seg)


def _bwd(a, res, cts):
    q, k, v, hist_k, hist_v, layer, start, q_seg, kv_seg = res
    do, ct_gk, ct_gv = cts
    T = k.shape[1]
    _, vjp = jax.vjp(lambda q, kk, vv: _attend(a, q, kk, vv, start, q_seg, kv_seg),
                     q, _merge(hist_k, k, start), _merge(hist_v, v, start))
    dq, dkk, dvv = vjp(do)

    def split(d, ct, own):
        """(the block's own cotangent, ct with layer `layer`'s history gradient added in place)."""
        hist = lax.dynamic_update_slice_in_dim(d, jnp.zeros_like(own), start, axis=1).astype(ct.dtype)
        row = lax.dynamic_index_in_dim(ct, layer, axis=0, keepdims=False) + hist
        return lax.dynamic_slice_in_dim(d, start, T, axis=1), lax.dynamic_update_index_in_dim(ct, row, layer, axis=0)

    dk, ct_gk = split(dkk, ct_gk, k)
    dv, ct_gv = split(dvv, ct_gv, v)
    return dq, dk, dv, ct_gk, ct_gv, None, None, None, None, None, None


history_attention.defvjp(_fwd, _bwd)
