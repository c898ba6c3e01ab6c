"""Chunked log-probs / entropy (custom VJP) against the full-logits reference: values, gradients, memory.

bfloat16 cases are compared with the reference evaluated in float32 on the same (bfloat16-valued)
inputs, so the tolerance measures the chunked path's own error. Gradients are compared relative to
the largest entry of the expected array (`atol` is a fraction of max(|expected|, 1)): entries of d_w sum
thousands of products and can cancel to near zero, where a purely elementwise bound means nothing.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.logprobs import token_logprobs, token_logprobs_reference

from kernels.testing.logprob_cases import (CHUNK, E, GRID, TOL, assert_close, cotangents, f32,  # noqa: F401
                                          make_case, outputs_and_grads)     # (shared with scripts/)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("n,v,temperature", GRID)
def test_forward_and_grads_match_reference(n, v, temperature, dtype):
    hidden, w, targets = make_case(n, v, dtype)
    g_logp, g_ent = cotangents(n)
    logp, ent, grads, grads_logp = outputs_and_grads(hidden, w, targets, g_logp, g_ent, "chunked", temperature)
    ref = outputs_and_grads(*f32(hidden, w), targets, g_logp, g_ent, "ref", temperature)
    assert logp.dtype == ent.dtype == jnp.float32 and logp.shape == ent.shape == (n,)
    assert_close(logp, ref[0], dtype)
    assert_close(ent, ref[1], dtype)
    for got, want in ((grads, ref[2]), (grads_logp, ref[3])):
        assert got[0].dtype == hidden.dtype and got[1].dtype == w.dtype
        assert_close(got[0], want[0], dtype)
        assert_close(got[1], want[1], dtype)


def test_batched_shapes_and_no_entropy():
    """[B, T, E] / [B, T] inputs give [B, T] outputs equal to the flattened call."""
    hidden, w, targets = make_case(2 * 19, 300, jnp.float32)

    @jax.jit
    def f(h, w_, t):
        return (token_logprobs(h.reshape(2, 19, E), w_, t.reshape(2, 19), chunk_size=CHUNK),
                token_logprobs(h, w_, t, chunk_size=CHUNK),
                token_logprobs(h.reshape(2, 19, E), w_, t.reshape(2, 19), chunk_size=CHUNK, return_entropy=False))
    (logp3, ent3), (logp, ent), (logp3_only, none) = f(hidden, w, targets)
    assert logp3.shape == ent3.shape == logp3_only.shape == (2, 19) and none is None
    np.testing.assert_allclose(logp3.reshape(-1), logp, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ent3.reshape(-1), ent, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(logp3_only, logp3, rtol=1e-6, atol=1e-6)


def test_chunk_sizes_and_extreme_logits():
    """Many chunks with a ragged tail (7), one exact chunk (100 = V), one chunk wider than V; huge logits
    (lse >> 0, near one-hot rows) stay finite."""
    hidden, w, targets = make_case(9, 100, jnp.float32)

    @jax.jit
    def f(h, w_, t):
        return ([token_logprobs(h, w_, t, chunk_size=c) for c in (7, 100, 4096)] + [token_logprobs_reference(h, w_, t)]
                + [token_logprobs(h * 300.0, w_, t, chunk_size=7), token_logprobs_reference(h * 300.0, w_, t)])
    *chunked, ref, big, big_ref = f(hidden, w, targets)
    for logp, ent in chunked:
        assert_close(logp, ref[0], jnp.float32)
        assert_close(ent, ref[1], jnp.float32)
    assert bool(jnp.all(jnp.isfinite(big[0])) and jnp.all(jnp.isfinite(big[1])))
    assert_close(big[0], big_ref[0], jnp.float32)
    assert_close(big[1], big_ref[1], jnp.float32)


def test_jit_matches_eager():
    hidden, w, targets = make_case(64, 1000, jnp.float32)
    f = lambda h, w_, t: token_logprobs(h, w_, t, temperature=0.7, chunk_size=CHUNK)  # noqa: E731
    for a, b in zip(jax.jit(f)(hidden, w, targets), f(hidden, w, targets)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_shape_errors_name_the_shapes():
    hidden, w, targets = make_case(8, 50, jnp.float32)
    with pytest.raises(ValueError, match=r"w \(16, 50\)"):
        token_logprobs(hidden, w[:16], targets)
    with pytest.raises(ValueError, match=r"targets \(7,\)"):
        token_logprobs(hidden, w, targets[:7])
    with pytest.raises(ValueError, match="integer"):
        token_logprobs(hidden, w, targets.astype(jnp.float32))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(hidden, w, targets, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(hidden, w, targets, chunk_size=0)


def _temp_bytes(impl, n, e, v, dtype):
    def loss(h, w_, t):
        logp, ent = impl(h, w_, t)
        return jnp.sum(logp) + 0.01 * jnp.sum(ent)
    args = (jax.ShapeDtypeStruct((n, e), dtype), jax.ShapeDtypeStruct((e, v), dtype),
            jax.ShapeDtypeStruct((n,), jnp.int32))
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_compiled_temp_memory_below_naive(dtype):
    """Structural: the chunked value_and_grad needs far less scratch than the [N, V] logits path."""
    n, e, v = 512, 64, 32768
    chunked = _temp_bytes(lambda h, w_, t: token_logprobs(h, w_, t, chunk_size=1024), n, e, v, dtype)
    naive = _temp_bytes(token_logprobs_reference, n, e, v, dtype)
    assert chunked < naive, (chunked, naive)
    assert chunked < n * v * 4, (chunked, n * v * 4)  # below even one float32 [N, V] logits array
