"""`kernels.attention_pairs` (query chunk × key chunk pairs skipped by `lax.cond` for a traced offset) against
`attention_reference`: forward and gradients over the attention kernel's case grid, and proof that the
invisible pairs are not computed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.attention import attention_reference
from kernels.attention_pairs import attention_pairs
from tests.test_attention_kernel import ATOL, CASES, make_inputs


def _out_and_grads(fwd, args, cot):
    out, vjp = jax.vjp(fwd, *args)
    return out, vjp(cot)


@pytest.mark.parametrize("name", sorted(CASES))
def test_pairs_match_reference_f32(name):
    """16 x 16 pairs with the offset passed as a traced argument (as the blockwise step passes it)."""
    c = CASES[name]
    args, cot, kw = make_inputs(c, jnp.float32)
    off = kw.pop("q_offset")

    @jax.jit
    def both(off):
        pairs = _out_and_grads(lambda q, k, v: attention_pairs(q, k, v, q_offset=off, **kw, block_q=16, block_k=16),
                               args, cot)
        ref = _out_and_grads(lambda q, k, v: attention_reference(q, k, v, q_offset=off, **kw), args, cot)
        return pairs, ref

    (out, grads), (ref_out, ref_grads) = both(jnp.asarray(off, jnp.int32))
    tol = ATOL[jnp.float32]
    np.testing.assert_allclose(out, ref_out, atol=tol["fwd"], rtol=0, err_msg=f"{name}: forward")
    for what, g, rg in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(g, rg, atol=tol["grad"], rtol=0, err_msg=f"{name}: d{what}")
    assert np.all(np.isfinite(out)) and all(np.all(np.isfinite(g)) for g in grads)


@pytest.mark.parametrize("window", [None, 20])
def test_invisible_pairs_are_not_computed(window):
    """NaN values in key chunks no query can see (after the causal bound, before the window) would reach
    the output through 0 * NaN if their pair were computed, as they do in the reference: the pairs path
    stays finite and equals the reference on clean values, in the forward and the backward."""
    T, S, off = 32, 128, 48                                        # queries at 48..79; chunks of 16
    ks = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(ks[0], (1, T, 2, 16))
    k, v = (jax.random.normal(x, (1, S, 1, 16)) for x in ks[1:3])
    cot = jax.random.normal(ks[3], q.shape)
    pos = np.arange(S)
    hidden = pos >= 80                                             # keys after the last query: pairs 5..7
    if window is not None:
        hidden |= pos < 16                                         # first query 48 sees keys > 28: pair 0
    dirty = jnp.where(jnp.asarray(hidden)[None, :, None, None], jnp.nan, v)
    kw = dict(causal=True, window=window)

    @jax.jit
    def run(off, v_in):
        return _out_and_grads(lambda q, v: attention_pairs(q, k, v, q_offset=off, **kw, block_q=16, block_k=16),
                              (q, v_in), cot)

    out, grads = run(jnp.int32(off), dirty)
    ref_out, ref_vjp = jax.vjp(lambda q, v: attention_reference(q, k, v, q_offset=off, **kw), q, v)
    ref_grads = ref_vjp(cot)
    assert np.isnan(np.asarray(attention_reference(q, k, dirty, q_offset=off, **kw))).any()   # the trap works
    np.testing.assert_allclose(out, ref_out, atol=ATOL[jnp.float32]["fwd"], rtol=0)
    np.testing.assert_allclose(grads[0], ref_grads[0], atol=ATOL[jnp.float32]["grad"], rtol=0)
    visible = ~hidden
    np.testing.assert_allclose(np.asarray(grads[1])[:, visible], np.asarray(ref_grads[1])[:, visible],
                               atol=ATOL[jnp.float32]["grad"], rtol=0)
    assert np.all(np.asarray(grads[1])[:, hidden] == 0)
