"""`kernels.logprob_loss.token_loss_sum` (loss gradient formed with the logits, token chunks) against its
unoptimised twin: full float32 logits (`token_logprobs_reference`) and autodiff of the summed loss.

Gradients are compared relative to the largest entry of the expected array, as in test_logprobs.py; the
summed loss relative to Σ|terms| (its rounding comes from the terms, which can cancel in the sum).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.logprob_loss import token_loss_sum
from kernels.logprobs import token_logprobs_reference

TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5)}   # set once; never loosened to make a test pass
E = 32


def assert_close(actual, expected, scale=None):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    scale = max(float(np.max(np.abs(expected))) if scale is None else scale, 1.0)
    np.testing.assert_allclose(actual, expected, rtol=TOL[jnp.float32]["rtol"], atol=TOL[jnp.float32]["atol"] * scale)


def per_token(logp, ent, aux, *, ent_coef):
    """A GRPO-like token loss: clipped ratio term, k3 KL to a reference, entropy bonus; weighted, masked."""
    ratio = jnp.exp(logp - aux["old"])
    pg = jnp.maximum(-aux["adv"] * ratio, -aux["adv"] * jnp.clip(ratio, 0.8, 1.28))
    d = aux["ref"] - logp
    return aux["w"] * aux["mask"] * (pg + 0.05 * (jnp.expm1(d) - d) - ent_coef * ent)


def make_case(R, L, V, seed=0):
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.normal(size=(R, L, E)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(E, V)) * (2.0 / E ** 0.5), jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, size=(R, L)), jnp.int32)
    aux = {k: jnp.asarray(rng.normal(size=(R, L)), jnp.float32) for k in ("adv", "w")}
    aux["old"] = jnp.asarray(rng.normal(size=(R, L)) * 0.3 - 4.0, jnp.float32)
    aux["ref"] = jnp.asarray(rng.normal(size=(R, L)) * 0.3 - 4.0, jnp.float32)
    aux["mask"] = jnp.asarray(rng.random((R, L)) < 0.8, jnp.float32)
    return hidden, w, targets, aux


def reference(hidden, w, targets, aux, fn, temperature, valid_vocab):
    def loss(h, w_):
        logp, ent = token_logprobs_reference(h, w_, targets, temperature=temperature, valid_vocab=valid_vocab)
        terms = fn(logp, ent, aux)
        return jnp.sum(terms), (logp, ent, jnp.sum(jnp.abs(terms)))
    (value, (logp, ent, abs_sum)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(hidden, w)
    return value, abs_sum, logp, ent, grads


# (rows, positions, vocab, chunk tokens, temperature, entropy coefficient, valid vocab): chunks that divide
# the positions and ones that leave a remainder, one chunk for everything, padded vocabulary.
GRID = [(4, 21, 300, 16, 1.0, 0.0, None), (3, 40, 257, 48, 0.7, 0.01, None), (2, 9, 120, 4096, 1.0, 0.02, None),
        (5, 13, 64, 10, 1.3, 0.01, 50)]


@pytest.mark.parametrize("R,L,V,chunk,temperature,ent_coef,valid_vocab", GRID)
def test_matches_full_logits_autodiff(R, L, V, chunk, temperature, ent_coef, valid_vocab):
    hidden, w, targets, aux = make_case(R, L, V)
    if valid_vocab is not None:
        targets = targets % valid_vocab
    fn = functools.partial(per_token, ent_coef=ent_coef)

    @jax.jit
    def fused(h, w_):
        def loss(h, w_):
            value, logp, ent = token_loss_sum(h, w_, targets, aux, fn, temperature=temperature,
                                              valid_vocab=valid_vocab, chunk_tokens=chunk)
            return value, (logp, ent)
        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(h, w_)

    (value, (logp, ent)), grads = fused(hidden, w)
    ref_value, abs_sum, ref_logp, ref_ent, ref_grads = jax.jit(reference, static_argnums=(4, 5, 6))(
        hidden, w, targets, aux, fn, temperature, valid_vocab)
    assert_close(value, ref_value, scale=float(abs_sum))
    assert_close(logp, ref_logp)
    assert_close(ent, ref_ent)
    for g, rg in zip(grads, ref_grads):
        assert_close(g, rg)
    if valid_vocab is not None:          # padded columns: exactly zero gradient
        assert np.all(np.asarray(grads[1])[:, valid_vocab:] == 0)
    assert np.abs(np.asarray(grads[1])).max() > 0


def test_outputs_carry_no_gradient_and_cotangent_scales():
    """logp/ent are values only; the loss's cotangent scales both gradients (the residuals are exact)."""
    hidden, w, targets, aux = make_case(2, 7, 50)
    fn = functools.partial(per_token, ent_coef=0.01)

    def through_logp(h):
        return jnp.sum(token_loss_sum(h, w, targets, aux, fn, chunk_tokens=4)[1])

    assert np.all(np.asarray(jax.grad(through_logp)(hidden)) == 0)
    g1 = jax.grad(lambda h: token_loss_sum(h, w, targets, aux, fn, chunk_tokens=4)[0])(hidden)
    g3 = jax.grad(lambda h: 3.0 * token_loss_sum(h, w, targets, aux, fn, chunk_tokens=4)[0])(hidden)
    np.testing.assert_allclose(np.asarray(g3), 3.0 * np.asarray(g1), rtol=1e-6)


def test_bad_arguments_fail_loudly_with_shapes():
    hidden, w, targets, aux = make_case(2, 7, 50)
    fn = functools.partial(per_token, ent_coef=0.0)
    with pytest.raises(ValueError, match=r"\[R, L, E\]"):
        token_loss_sum(hidden[0], w, targets, aux, fn)
    with pytest.raises(ValueError, match="aux array"):
        token_loss_sum(hidden, w, targets, {**aux, "adv": aux["adv"][:, :3]}, fn)
    with pytest.raises(ValueError, match="valid_vocab"):
        token_loss_sum(hidden, w, targets, aux, fn, valid_vocab=51)
    with pytest.raises(ValueError, match="temperature"):
        token_loss_sum(hidden, w, targets, aux, fn, temperature=0.0)


def _masked_case(R, L, V, seed, fill):
    """`make_case` with a loss mask whose rows hold loss positions on a `fill` share of their first positions
    (a packed micro-batch: prompts, responses, padding at the end; one row without any)."""
    hidden, w, targets, aux = make_case(R, L, V, seed)
    rng = np.random.default_rng(seed + 1)
    mask = (rng.random((R, L)) < 0.6) & (np.arange(L)[None, :] < np.round(fill * L * rng.random((R, 1))))
    mask[-1] = False
    aux["mask"] = jnp.asarray(mask, jnp.float32)
    return hidden, w, targets, aux


# (rows, positions, vocab, chunk tokens, fill): several chunks over rows filled to a share of their length
MASKED = [(4, 37, 200, 16, 0.5), (3, 64, 130, 24, 0.9), (2, 50, 90, 6, 0.2), (6, 9, 70, 12, 1.0)]


@pytest.mark.parametrize("R,L,V,chunk,fill", MASKED)
def test_loss_positions_only_equal_every_position(R, L, V, chunk, fill):
    """`mask`: the projection runs over each row's loss positions only (moved to the front, the chunk loop
    stopped after the longest row's last one). Against the same kernel over every position: the loss, both
    gradients, and logp/ent on the loss positions (0 elsewhere), within float32 rounding (the chunks sum
    other tokens together)."""
    hidden, w, targets, aux = _masked_case(R, L, V, seed=R * L, fill=fill)
    fn = functools.partial(per_token, ent_coef=0.01)

    def run(mask):
        def loss(h, w_):
            value, logp, ent = token_loss_sum(h, w_, targets, aux, fn, chunk_tokens=chunk, temperature=0.9, mask=mask)
            return value, (logp, ent)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(hidden, w)

    (value, (logp, ent)), grads = run(aux["mask"])
    (ref_value, (ref_logp, ref_ent)), ref_grads = run(None)
    keep = np.asarray(aux["mask"]) > 0
    assert_close(value, ref_value, scale=float(np.sum(np.abs(np.asarray(ref_logp)))))
    assert_close(logp, np.where(keep, ref_logp, 0.0))
    assert_close(ent, np.where(keep, ref_ent, 0.0))
    for g, rg in zip(grads, ref_grads):
        assert_close(g, rg)
    assert np.abs(np.asarray(grads[0])).max() > 0
    assert np.all(np.asarray(grads[0])[~keep] == 0)        # no gradient into positions without loss


def test_chunks_past_the_last_loss_position_are_not_computed():
    """NaN hidden states after every row's last loss position (and its chunk): with `mask` they never reach the
    projection (finite loss and gradients); over every position they do."""
    hidden, w, targets, aux = make_case(3, 40, 60)
    mask = np.zeros((3, 40), np.float32)
    mask[:, 2:7] = 1.0
    aux["mask"] = jnp.asarray(mask)
    hidden = hidden.at[:, 20:].set(jnp.nan)          # chunks of 8 positions (24 tokens / 3 rows): 0-7 holds them all
    fn = functools.partial(per_token, ent_coef=0.0)
    loss = lambda h, m: token_loss_sum(h, w, targets, aux, fn, chunk_tokens=24, mask=m)[0]  # noqa: E731
    value, g = jax.value_and_grad(loss)(hidden, aux["mask"])
    assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(g)))
    assert np.isnan(float(loss(hidden, None)))
    empty = jnp.zeros_like(aux["mask"])               # no loss position at all: no chunk runs
    value, g = jax.value_and_grad(loss)(hidden, empty)
    assert float(value) == 0.0 and np.all(np.asarray(g) == 0)


def test_loss_positions_on_a_sharded_mesh_equal_one_device():
    """Rows over fsdp=4 (the train layout's data split) and the projection's vocabulary over tp=2: the compaction
    is per row, so each device moves its own rows' positions; the loss and gradients equal one device's."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    hidden, w, targets, aux = _masked_case(8, 48, 96, seed=3, fill=0.7)
    fn = functools.partial(per_token, ent_coef=0.01)

    def loss(h, w_, t, a):
        return token_loss_sum(h, w_, t, a, fn, chunk_tokens=64, mask=a["mask"])[0]

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    want, want_g = step(hidden, w, targets, aux)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tp"))
    rows = NamedSharding(mesh, P("fsdp", None))
    put = lambda x: jax.device_put(x, rows)  # noqa: E731
    got, got_g = step(jax.device_put(hidden, NamedSharding(mesh, P("fsdp", None, None))),
                      jax.device_put(w, NamedSharding(mesh, P(None, "tp"))), put(targets), jax.tree.map(put, aux))
    assert_close(got, want, scale=float(np.sum(np.abs(np.asarray(aux["mask"])))))
    for g, rg in zip(got_g, want_g):
        assert_close(g, rg)
