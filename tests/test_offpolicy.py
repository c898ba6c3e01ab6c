"""Off-policy corrections (`jaxrl.algos.offpolicy`) against values computed by hand, and GSPO-token (the
trainer's per-token form) against GSPO's sequence-level objective: the same value and gradient."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import algos
from jaxrl.algos import offpolicy

F32_TOL = dict(rtol=1e-6, atol=1e-6)
log = math.log


def test_importance_weights_by_hand():
    prox = jnp.array([[log(0.5), log(0.3), log(0.9), 0.0]])
    behav = jnp.array([[log(0.25), log(0.3), log(0.1), 7.0]])     # the last token is padding
    mask = jnp.array([[1, 1, 1, 0]])
    for mode, want in (("none", [2, 1, 9, 1]), ("truncate", [2, 1, 2, 1]), ("mask", [2, 1, 0, 1])):
        w, m = offpolicy.importance_weights(prox, behav, mask, cap=2.0, mode=mode)
        np.testing.assert_allclose(w[0], want, **F32_TOL)
        np.testing.assert_allclose(m["is_weight_mean"], 4.0, rtol=1e-6)
        np.testing.assert_allclose(m["is_weight_max"], 9.0, rtol=1e-6)
        np.testing.assert_allclose(m["is_truncated_frac"], 0.0 if mode == "none" else 1 / 3, rtol=1e-6)
    with pytest.raises(ValueError, match="valid choices: none, truncate, mask"):
        offpolicy.importance_weights(prox, behav, mask, mode="clip")
    with pytest.raises(ValueError, match="cap=0 must be > 0"):
        offpolicy.importance_weights(prox, behav, mask, cap=0, mode="truncate")


def test_decoupled_ppo_by_hand():
    """Token 1: u = 0.55/0.5 = 1.1 (inside the clip), w = 0.5/0.25 = 2, A = 1: ℓ = −2·1.1, dℓ/dlogp = −2.2.
    Token 2: u = 0.2/0.4 = 0.5, w = 1, A = −1: the clip holds it at 0.8 (ℓ = 0.8, no gradient). Token mean."""
    logp = jnp.array([[log(0.55), log(0.2)]])
    prox = jnp.array([[log(0.5), log(0.4)]])
    behav = jnp.array([[log(0.25), log(0.4)]])
    adv, mask = jnp.array([[1.0, -1.0]]), jnp.ones((1, 2))
    f = lambda lp, **kw: offpolicy.decoupled_policy_loss(lp, prox, behav, adv, mask, clip_low=0.2, **kw)[0]  # noqa: E731
    np.testing.assert_allclose(f(logp), (-2.2 + 0.8) / 2, rtol=1e-6)
    np.testing.assert_allclose(jax.grad(f)(logp), [[-1.1, 0.0]], **F32_TOL)
    np.testing.assert_allclose(f(logp, is_cap=1.5, is_mode="truncate"), (-1.5 * 1.1 + 0.8) / 2, rtol=1e-6)
    np.testing.assert_allclose(f(logp, is_cap=1.5, is_mode="mask"), (0.0 + 0.8) / 2, rtol=1e-6)
    _, m = offpolicy.decoupled_policy_loss(logp, prox, behav, adv, mask, clip_low=0.2)
    np.testing.assert_allclose([m["clip_frac"], m["ratio_mean"], m["is_weight_mean"]], [0.5, 0.8, 1.5], rtol=1e-6)


def test_decoupled_equals_ppo_when_behaviour_is_proximal():
    rng = np.random.default_rng(0)
    logp, prox = (jnp.asarray(rng.normal(-1.0, 0.3, (3, 5)), jnp.float32) for _ in range(2))
    adv = jnp.asarray(rng.normal(size=(3, 5)), jnp.float32)
    mask = jnp.asarray(rng.random((3, 5)) > 0.3)
    for agg in ("token-mean", "seq-mean-token-mean"):
        ppo = lambda lp: algos.policy_loss(lp, prox, adv, mask, clip_low=0.2, clip_high=0.28, agg=agg)[0]  # noqa: E731
        dec = lambda lp: offpolicy.decoupled_policy_loss(lp, prox, prox, adv, mask, clip_low=0.2,  # noqa: E731
                                                         clip_high=0.28, agg=agg, is_cap=2.0, is_mode="truncate")[0]
        assert float(ppo(logp)) == float(dec(logp))
        np.testing.assert_array_equal(jax.grad(ppo)(logp), jax.grad(dec)(logp))


def test_gspo_by_hand():
    """Sequence 1: log-ratios (0.1, −0.3), s = e^−0.1, A = 1: ℓ = −s, dℓ/dlogp_t = −s/2. Sequence 2: (0.3, 0.3, 0.3),
    s = e^0.3 > 1.2, A = −1: the unclipped branch is the larger loss, ℓ = s, dℓ/dlogp_t = s/3. Mean over the two."""
    old = jnp.zeros((2, 3))
    logp = jnp.array([[0.1, -0.3, 0.0], [0.3, 0.3, 0.3]])
    mask = jnp.array([[1, 1, 0], [1, 1, 1]])
    adv = jnp.array([1.0, -1.0])
    f = lambda lp: offpolicy.gspo_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2)[0]  # noqa: E731
    s1, s2 = math.exp(-0.1), math.exp(0.3)
    np.testing.assert_allclose(f(logp), (-s1 + s2) / 2, rtol=1e-6)
    np.testing.assert_allclose(jax.grad(f)(logp), [[-s1 / 4, -s1 / 4, 0.0], [s2 / 6] * 3], **F32_TOL)
    _, m = offpolicy.gspo_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    np.testing.assert_allclose([m["clip_frac"], m["seq_ratio_mean"]], [0.0, (s1 + s2) / 2], rtol=1e-6)


def test_gspo_token_equals_sequence_level():
    """What the trainer computes (GSPO-token: per-token ratio with the sequence ratio as a constant, PPO's clip,
    "seq-mean-token-mean") has GSPO's value and gradient, clipped sequences included (the paper's ε)."""
    rng = np.random.default_rng(1)
    B, T = 6, 7
    old = jnp.asarray(rng.normal(-1.0, 0.5, (B, T)), jnp.float32)
    logp = old + jnp.asarray(rng.normal(0, 4e-4, (B, T)), jnp.float32)     # a few sequences beyond ε
    mask = jnp.asarray(np.arange(T)[None, :] < rng.integers(2, T + 1, B)[:, None])
    adv_seq = jnp.asarray(rng.normal(size=B), jnp.float32)
    adv = jnp.broadcast_to(adv_seq[:, None], (B, T))

    def token_form(lp):
        s = jnp.exp(offpolicy.sequence_log_ratio(jax.lax.stop_gradient(lp), old, mask))[:, None] * jnp.ones((1, T))
        tok, _, _ = algos.ppo_clip_token_loss(offpolicy.gspo_token_ratio(lp, s), adv, clip_low=3e-4, clip_high=4e-4)
        return algos.aggregate(tok, mask, "seq-mean-token-mean")

    seq_form = lambda lp: offpolicy.gspo_policy_loss(lp, old, adv, mask)[0]  # noqa: E731
    clipped = offpolicy.gspo_policy_loss(logp, old, adv, mask)[1]["clip_frac"]
    assert 0 < float(clipped) < 1, clipped
    np.testing.assert_allclose(token_form(logp), seq_form(logp), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(token_form)(logp), jax.grad(seq_form)(logp), rtol=1e-5, atol=1e-7)


def test_packed_sequence_ratio_equals_per_sequence():
    """Three sequences packed into two rows (segment ids 1, 2 | 1, then padding) give each token its sequence's
    s_i, as `sequence_log_ratio` of each sequence alone."""
    rng = np.random.default_rng(2)
    seqs = [(rng.normal(size=n), rng.normal(size=n), rng.random(n) > 0.2) for n in (4, 3, 5)]
    logp, old = np.zeros((2, 8), np.float32), np.zeros((2, 8), np.float32)
    seg, mask = np.zeros((2, 8), np.int32), np.zeros((2, 8), np.float32)
    for (r, off, sid), (lp, o, m) in zip([(0, 0, 1), (0, 4, 2), (1, 0, 1)], seqs):
        n = len(lp)
        logp[r, off:off + n], old[r, off:off + n], seg[r, off:off + n], mask[r, off:off + n] = lp, o, sid, m
    got = np.asarray(offpolicy.packed_sequence_ratio(logp, old, seg, mask))
    for (r, off, _), (lp, o, m) in zip([(0, 0, 1), (0, 4, 2), (1, 0, 1)], seqs):
        want = np.exp(offpolicy.sequence_log_ratio(lp[None], o[None], m[None]))[0]
        np.testing.assert_allclose(got[r, off:off + len(lp)], want, rtol=1e-6)
    assert got[1, 5:].tolist() == [1.0] * 3                      # padding


def test_staleness_mask():
    versions = jnp.array([[3, 3, 4], [1, 2, 4]])
    np.testing.assert_array_equal(offpolicy.staleness_mask(versions, 4, 2), [[1, 1, 1], [0, 1, 1]])
    np.testing.assert_array_equal(offpolicy.staleness_mask(versions, 4, 0, mask=jnp.array([[1, 1, 0], [1, 1, 1]])),
                                  [[0, 0, 0], [0, 0, 1]])
    with pytest.raises(ValueError, match="max_staleness=-1"):
        offpolicy.staleness_mask(versions, 4, -1)
