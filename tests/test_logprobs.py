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

# Set once per dtype (of hidden and w); never loosened to make a test pass.
TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}
CHUNK = 128
E = 32


def assert_close(actual, expected, dtype):
    actual = np.asarray(jnp.asarray(actual, jnp.float32))
    expected = np.asarray(jnp.asarray(expected, jnp.float32))
    tol = TOL[dtype]
    scale = max(float(np.max(np.abs(expected))), 1.0) if expected.size else 1.0
    np.testing.assert_allclose(actual, expected, rtol=tol["rtol"], atol=tol["atol"] * scale)


def make_case(n, v, dtype, seed=0, e=E):
    """hidden [n, e], w [e, v] with logits of std ~2 (max logit ~ +8 over thousands of columns), targets."""
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.normal(size=(n, e)), jnp.float32).astype(dtype)
    w = jnp.asarray(rng.normal(size=(e, v)) * (2.0 / e ** 0.5), jnp.float32).astype(dtype)
    targets = jnp.asarray(rng.integers(0, v, size=n), jnp.int32)
    return hidden, w, targets


def cotangents(n, seed=1):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(size=n), jnp.float32), jnp.asarray(rng.normal(size=n), jnp.float32)


def f32(*xs):
    return tuple(x.astype(jnp.float32) for x in xs)


# (tokens, vocab) with vocab below one chunk and spanning many chunks plus a ragged tail; two temperatures.
GRID = [(n, v, t) for n, v in [(37, 100), (300, 5000)] for t in (1.0, 0.7)]


def outputs_and_grads(hidden, w, targets, g_logp, g_ent, impl, temperature):
    """Under one jit: logp, entropy, (d_hidden, d_w) for cotangents on both outputs, and (d_hidden, d_w)
    for the logp cotangent alone (the chunked path then runs with `return_entropy=False`)."""
    def run(h, w_, entropy=True):
        if impl == "ref":
            return token_logprobs_reference(h, w_, targets, temperature=temperature)
        return token_logprobs(h, w_, targets, temperature=temperature, chunk_size=CHUNK, return_entropy=entropy)

    @jax.jit
    def f(h, w_):
        (logp, ent), vjp = jax.vjp(run, h, w_)
        logp_only = jax.grad(lambda h, w_: jnp.sum(run(h, w_, False)[0] * g_logp), argnums=(0, 1))(h, w_)
        return logp, ent, vjp((g_logp, g_ent)), logp_only
    return f(hidden, w)


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
