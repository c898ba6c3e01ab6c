"""The on-device sampler: argmax, inverse-CDF draws, top-k/top-p truncation, log-probs, seeds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.rollout.sampling import (SamplingBatch, SamplingParams, _argmax, _ordered, inverse_cdf, sample,
                                    truncation_threshold)

V = 300  # spans three 128-wide blocks plus a ragged tail


def batch(rows, bucket=None):
    sb = SamplingBatch.build(rows, bucket or len(rows))
    return jax.tree.map(jnp.asarray, sb)


def test_argmax_matches_jnp_with_ties_first():
    x = np.random.default_rng(0).normal(size=(5, V)).astype(np.float32)
    x[1, [7, 250]] = 10.0  # a tie: the first index wins, as in jnp.argmax
    x[2, :] = 0.0
    np.testing.assert_array_equal(_argmax(jnp.asarray(x)), jnp.argmax(x, axis=-1))


def test_inverse_cdf_follows_the_weights_and_skips_zeros():
    rng = np.random.default_rng(1)
    w = rng.random(V).astype(np.float32)
    w[rng.random(V) < 0.5] = 0.0
    w[-3:] = 0.0  # zero tail: rounding must never land there
    n = 20000
    u = (np.arange(n, dtype=np.float32) + 0.5) / n          # a deterministic uniform grid
    idx = np.asarray(inverse_cdf(jnp.broadcast_to(jnp.asarray(w), (n, V)), jnp.asarray(u)))
    assert np.all(w[idx] > 0)
    freq = np.bincount(idx, minlength=V) / n
    np.testing.assert_allclose(freq, w / w.sum(), atol=2.0 / n)
    edges = inverse_cdf(jnp.asarray(np.stack([w, w])), jnp.asarray([0.0, np.nextafter(1.0, 0.0)], jnp.float32))
    assert int(edges[0]) == int(np.flatnonzero(w)[0]) and int(edges[1]) == int(np.flatnonzero(w)[-1])


def draws(logits, params, n):
    """n draws (seeds 0..n-1, one batch) of one logits row under `params`."""
    sb = batch([(params, seed, 0) for seed in range(n)])
    return sample(jnp.broadcast_to(logits, (n, V)), sb)


def test_sampled_frequencies_and_logprobs():
    logits = jnp.asarray(np.random.default_rng(2).normal(size=V) * 2, jnp.float32)
    p = jax.nn.softmax(logits / 0.7)
    tok, logp = draws(logits, SamplingParams(temperature=0.7), 4000)
    np.testing.assert_allclose(logp, jnp.log(p)[tok], atol=1e-5)
    freq = np.bincount(np.asarray(tok), minlength=V) / 4000
    p = np.asarray(p)
    top = np.argsort(-p)[:10]                              # the likely tokens, counts well above noise
    assert np.all(np.abs(freq[top] - p[top]) <= 4 * np.sqrt(p[top] / 4000) + 1e-3)  # 4 sigma, fixed seeds


def test_top_k_and_top_p_truncate_but_logprobs_do_not():
    logits = jnp.asarray(np.random.default_rng(3).normal(size=V) * 3, jnp.float32)
    order = np.argsort(-np.asarray(logits))
    tok, logp = draws(logits, SamplingParams(temperature=1.0, top_k=5), 2000)
    assert set(np.asarray(tok).tolist()) <= set(order[:5].tolist())
    assert len(set(np.asarray(tok).tolist())) == 5
    np.testing.assert_allclose(logp, jax.nn.log_softmax(logits)[tok], atol=1e-5)  # before truncation

    p = np.asarray(jax.nn.softmax(logits))[order]
    n_keep = int(np.sum(np.cumsum(p) - p < 0.8))             # smallest prefix reaching 0.8 mass
    tok, _ = draws(logits, SamplingParams(temperature=1.0, top_p=0.8), 2000)
    assert set(np.asarray(tok).tolist()) <= set(order[:n_keep].tolist())


def test_mixed_batch_rows_keep_their_own_params():
    logits = jnp.asarray(np.random.default_rng(4).normal(size=(4, V)) * 3, jnp.float32)
    rows = [(SamplingParams(temperature=0.0), 0, 0), (SamplingParams(temperature=1.0, top_k=1), 1, 0),
            (SamplingParams(temperature=1.0), 2, 0), (SamplingParams(temperature=1.0, top_p=0.5), 3, 0)]
    sb = batch(rows)
    assert sb.truncate
    tok, logp = sample(logits, sb)
    best = np.asarray(jnp.argmax(logits, axis=-1))
    assert tok[0] == best[0] and tok[1] == best[1]
    np.testing.assert_allclose(logp, jnp.take_along_axis(jax.nn.log_softmax(logits), tok[:, None], -1)[:, 0],
                               atol=1e-5)
    # The untruncated row draws the same token whether or not the batch compiles the truncation.
    alone, _ = sample(logits[2:3], batch(rows[2:3]))
    assert not batch(rows[2:3]).truncate and int(alone[0]) == int(tok[2])


@pytest.mark.parametrize("bucket", [1, 4])
def test_same_seed_and_step_same_token_anywhere_in_the_batch(bucket):
    logits = jnp.asarray(np.random.default_rng(5).normal(size=V), jnp.float32)
    params = SamplingParams(temperature=1.0)
    want = int(sample(logits[None], batch([(params, 42, 3)]))[0][0])
    others = [(params, s, 0) for s in range(bucket - 1)]
    tok, _ = sample(jnp.broadcast_to(logits, (bucket, V)), batch(others + [(params, 42, 3)]))
    assert int(tok[-1]) == want


def kept_by_sort(x, k, p):
    """Oracle: sort descending, keep the top k and the smallest prefix whose preceding mass is < p."""
    order = np.argsort(-x, kind="stable")
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    keep = np.zeros(len(x), bool)
    n = len(x) if k == 0 else min(k, len(x))
    before = np.cumsum(probs[order]) - probs[order]
    n = min(n, max(1, int(np.sum(before < p)))) if p < 1 else n
    keep[order[:n]] = True
    return keep


@pytest.mark.parametrize("k,p", [(0, 0.9), (5, 1.0), (40, 0.5), (1, 0.99), (0, 0.999), (500, 0.3)])
def test_truncation_threshold_matches_sorting(k, p):
    x = np.random.default_rng(6).normal(size=(3, V)).astype(np.float32) * np.array([[0.5], [2.0], [8.0]], np.float32)
    x[0, :10] = -x[0, :10]  # negative and positive logits both near the boundary
    probs = jax.nn.softmax(jnp.asarray(x), axis=-1)
    thr = truncation_threshold(jnp.asarray(x), probs, jnp.full((3,), k, jnp.int32), jnp.full((3,), p, jnp.float32))
    kept = np.asarray(_ordered(jnp.asarray(x)) >= thr)
    for row in range(3):
        np.testing.assert_array_equal(kept[row], kept_by_sort(x[row].astype(np.float64), k, p))


def test_truncation_keeps_boundary_ties_together():
    x = jnp.asarray([[3.0, 1.0, 1.0, 1.0, -2.0]], jnp.float32)
    probs = jax.nn.softmax(x, axis=-1)
    thr = truncation_threshold(x, probs, jnp.asarray([2], jnp.int32), jnp.asarray([1.0], jnp.float32))
    assert np.asarray(_ordered(x) >= thr).tolist() == [[True, True, True, True, False]]


def test_decode_inputs_pack_round_trip():
    """`model_step.DecodeInputs` packs a decode step's nine per-row host inputs into one int32 array (one
    transfer a step); unpacked inside a compiled function they are the same values bit for bit: negative
    `src` (-1: the token is on the host), seeds above 2**31, float temperatures and top-p, the page table."""
    from jaxrl.rollout.model_step import DecodeInputs

    rows = [(SamplingParams(temperature=0.7, top_k=5, top_p=0.9), 2**32 - 3, 4), (SamplingParams(temperature=0.0), 7, 0),
            (SamplingParams(temperature=1.3, top_p=0.25), 2**31 + 11, 9)]
    sb = SamplingBatch.build(rows, 4)
    src, tokens, positions = np.array([-1, 2, 0, -1], np.int32), np.array([5, 0, 0, 3], np.int32), np.arange(4, dtype=np.int32) * 7
    table = np.arange(24, dtype=np.int32).reshape(4, 6)
    x = DecodeInputs.pack(src, tokens, positions, table, sb)
    assert x.packed.dtype == np.int32 and x.packed.shape == (4, len(DecodeInputs.COLUMNS) + 6) and x.truncate
    got = jax.jit(lambda d: d.unpack())(DecodeInputs(jnp.asarray(x.packed), x.truncate))
    for want, have in zip((src, tokens, positions, table), got[:4]):
        np.testing.assert_array_equal(np.asarray(have), want)
    for field in ("temperature", "top_k", "top_p", "seed", "step"):
        want, have = getattr(sb, field), np.asarray(getattr(got[4], field))
        assert have.dtype == want.dtype, field
        np.testing.assert_array_equal(have, want, err_msg=field)
    assert got[4].truncate
