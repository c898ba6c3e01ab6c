"""The chunked log-prob kernel's test cases (`tests/test_logprobs.py`, `scripts/gpu_check_kernels.py`):
tolerances per dtype, a case with logits of std ~2, cotangents, and the outputs and gradients of one
implementation under one jit."""

import jax
import jax.numpy as jnp
import numpy as np

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
