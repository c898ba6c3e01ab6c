"""jaxrl.algos against hand-computed values (expected numbers are written out or computed with numpy
loops here, never by calling the function under test)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import algos

ATOL = 1e-5


def close(a, b, atol=ATOL):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b, dtype=np.float32), atol=atol, rtol=1e-5)


# ------------------------------------------------------------------------------------------ masks


def test_last_token_mask_ragged_gap_and_empty_row():
    mask = jnp.array([[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    close(algos.last_token_mask(mask), [[0, 0, 1, 0], [0, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0, 1]])


# ------------------------------------------------------------------------------------- advantages

RAGGED8 = jnp.array([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]])


def test_grpo_group_normalised_and_constant_group_is_zero():
    rewards = jnp.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    adv = algos.compute_advantages("grpo", rewards=rewards, mask=RAGGED8)
    # group 1: mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.57735 -> ±0.5 / 0.57735 = ±0.866025
    a = 0.5 / np.sqrt(1.0 / 3.0)
    seq = np.array([a, -a, -a, a, 0, 0, 0, 0])
    close(adv, seq[:, None] * np.asarray(RAGGED8))
    assert adv.shape == (8, 3) and adv.dtype == jnp.float32
    # population std (ddof=0): std 0.5 -> ±1; no std: ±0.5
    close(algos.grpo_advantages(rewards, RAGGED8, ddof=0)[:4, 0], [1, -1, -1, 1])
    close(algos.grpo_advantages(rewards, RAGGED8, std_normalize=False)[:4, 0], [0.5, -0.5, -0.5, 0.5])


def test_dr_grpo_is_mean_centred_only():
    rewards = jnp.array([[1.0, 0.0, 0.0, 1.0], [2.0, 4.0, 6.0, 0.0]])
    adv = algos.compute_advantages("dr_grpo", rewards=rewards, mask=RAGGED8)
    seq = np.array([0.5, -0.5, -0.5, 0.5, -1.0, 1.0, 3.0, -3.0])
    close(adv, seq[:, None] * np.asarray(RAGGED8))


def test_rloo_leave_one_out_baseline():
    rewards = jnp.array([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]])
    adv = algos.compute_advantages("rloo", rewards=rewards, mask=jnp.ones((8, 2)))
    # r_i - mean(others): 1 - 1/3, 0 - 2/3; 3 - 5/3, 1 - 7/3, 2 - 2, 2 - 2
    close(adv[:, 0], [2 / 3, -2 / 3, -2 / 3, 2 / 3, 4 / 3, -4 / 3, 0.0, 0.0])
    with pytest.raises(ValueError, match="at least 2"):
        algos.rloo_advantages(jnp.ones((3, 1)), jnp.ones((3, 2)))


def test_outcome_token_rewards_last_token_minus_kl():
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]])
    kl = jnp.array([[0.1, 0.2, 0.3, 9.0], [0.4, 0.5, 9.0, 9.0]])
    tr = algos.outcome_token_rewards(jnp.array([1.0, 0.0]), mask, kl=kl, kl_coef=0.5)
    close(tr, [[-0.05, -0.1, 0.85, 0.0], [-0.2, -0.25, 0.0, 0.0]])


def test_reinforce_pp_discounting_and_global_normalisation():
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]])
    kl = jnp.array([[0.1, 0.2, 0.3, 9.0], [0.4, 0.5, 9.0, 9.0]])
    adv = algos.compute_advantages("reinforce_pp", rewards=jnp.array([1.0, 0.0]), mask=mask, kl=kl,
                                   kl_coef=0.5, gamma=0.5)
    # token rewards [-.05, -.1, .85 | -.2, -.25]; returns with gamma .5 (by hand):
    # row 0: .85, -.1 + .5*.85 = .325, -.05 + .5*.325 = .1125;  row 1: -.25, -.2 + .5*-.25 = -.325
    ret = np.array([0.1125, 0.325, 0.85, -0.325, -0.25])
    norm = (ret - ret.mean()) / np.sqrt(ret.var() + 1e-8)
    close(adv, [[norm[0], norm[1], norm[2], 0.0], [norm[3], norm[4], 0.0, 0.0]])


def test_reinforce_pp_group_baseline():
    mask = jnp.array([[1, 1], [1, 0], [1, 1], [1, 1]])
    adv = algos.reinforce_pp_advantages(jnp.array([1.0, 0.0, 3.0, 1.0]), mask, group_size=2)
    # centred: [.5, -.5, 1, -1]; gamma 1, no KL: every valid token carries its row's value
    tok = np.array([0.5, 0.5, -0.5, 1.0, 1.0, -1.0, -1.0])
    norm = (tok - tok.mean()) / np.sqrt(tok.var() + 1e-8)
    close(adv, [[norm[0], norm[1]], [norm[2], 0.0], [norm[3], norm[4]], [norm[5], norm[6]]])
    with pytest.raises(ValueError, match="groups of 3"):
        algos.reinforce_pp_advantages(jnp.ones(4), mask, group_size=3)


def _gae_numpy(r, v, m, gamma, lam):
    adv = np.zeros_like(r)
    for b in range(r.shape[0]):
        idx = [t for t in range(r.shape[1]) if m[b, t]]
        next_v, next_a = 0.0, 0.0
        for t in reversed(idx):
            delta = r[b, t] + gamma * next_v - v[b, t]
            next_a = delta + gamma * lam * next_a
            next_v = v[b, t]
            adv[b, t] = next_a
    return adv, (adv + v) * m


def test_gae_against_numpy_loop():
    rng = np.random.default_rng(0)
    B, T = 4, 7
    r = rng.normal(size=(B, T)).astype(np.float32)
    v = rng.normal(size=(B, T)).astype(np.float32)
    m = np.ones((B, T), np.float32)
    m[0, 5:] = 0          # ragged
    m[1, 2] = 0           # a masked gap inside the response
    m[1, 6:] = 0
    m[3, 1:] = 0          # a single token
    r, v = r * m, v * m
    exp_adv, exp_ret = _gae_numpy(r, v, m, 0.9, 0.8)
    adv, ret = algos.compute_advantages("gae", token_rewards=r, values=v, mask=m, gamma=0.9, lam=0.8,
                                        whiten=False)
    close(adv, exp_adv)
    close(ret, exp_ret)
    adv_w, ret_w = algos.gae_advantages(r, v, m, gamma=0.9, lam=0.8)
    vals = exp_adv[m > 0]
    close(adv_w[m > 0], (vals - vals.mean()) / np.sqrt(vals.var() + 1e-8))
    close(adv_w[m == 0], np.zeros(int((m == 0).sum())))
    close(ret_w, exp_ret)     # returns come from the raw advantages


def test_gae_hand_values():
    # single sequence, 3 tokens, outcome reward 1 at the end, gamma=1, lam=1 -> A_t = 1 - V_t
    v = jnp.array([[0.2, 0.5, 0.9]])
    adv, ret = algos.gae_advantages(jnp.array([[0.0, 0.0, 1.0]]), v, jnp.ones((1, 3)), gamma=1.0, lam=1.0,
                                    whiten=False)
    close(adv, [[0.8, 0.5, 0.1]])
    close(ret, [[1.0, 1.0, 1.0]])


# ----------------------------------------------------------------------------------- policy loss

RATIOS = np.array([1.5, 0.5, 1.5, 0.5, 1.1], np.float32)
ADVS = np.array([1.0, 1.0, -1.0, -1.0, 1.0], np.float32)


def _batch(ratios, advs):
    """One row of the given ratios plus a padding slot with garbage log-probs."""
    old = np.full((1, len(ratios) + 1), -1.0, np.float32)
    logp = old.copy()
    logp[0, :-1] += np.log(ratios)
    logp[0, -1] = 100.0                     # exp(101) would overflow float32
    adv = np.append(advs, 7.0)[None].astype(np.float32)
    mask = np.append(np.ones(len(ratios)), 0)[None]
    return jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask)


def test_ppo_clip_values_and_metrics():
    logp, old, adv, mask = _batch(RATIOS, ADVS)
    loss, m = algos.policy_loss(logp, old, adv, mask, clip_low=0.2)
    # per token: A>0,r=1.5 -> -1.2 (clipped); A>0,r=.5 -> -.5; A<0,r=1.5 -> 1.5; A<0,r=.5 -> .8 (clipped);
    # A>0,r=1.1 -> -1.1
    close(loss, (-1.2 - 0.5 + 1.5 + 0.8 - 1.1) / 5)
    close(m["clip_frac"], 2 / 5)
    close(m["clip_frac_high"], 1 / 5)
    close(m["clip_frac_low"], 1 / 5)
    close(m["dual_clip_frac"], 0.0)
    close(m["ratio_mean"], RATIOS.mean())
    close(m["approx_kl"], np.mean(RATIOS - 1 - np.log(RATIOS)))
    assert all(np.isfinite(np.asarray(x)) for x in m.values())


def test_ppo_grad_zero_on_clipped_tokens_and_padding():
    logp, old, adv, mask = _batch(RATIOS, ADVS)
    g = jax.grad(lambda lp: algos.policy_loss(lp, old, adv, mask)[0])(logp)
    # d(-A r)/d logp = -A r, over 5 tokens; clipped tokens 0 and 3 and the padding slot get 0
    close(g, [[0.0, -0.5 / 5, 1.5 / 5, 0.0, -1.1 / 5, 0.0]])


def test_clip_higher_asymmetry():
    ratios = np.array([1.25, 1.3, 0.75], np.float32)
    advs = np.array([1.0, 1.0, -1.0], np.float32)
    logp, old, adv, mask = _batch(ratios, advs)
    loss_sym, m_sym = algos.policy_loss(logp, old, adv, mask, clip_low=0.2)
    loss_hi, m_hi = algos.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    close(loss_sym, (-1.2 - 1.2 + 0.8) / 3)     # 1.25 and 1.3 clipped at 1.2; .75 clipped at .8
    close(loss_hi, (-1.25 - 1.28 + 0.8) / 3)    # 1.25 now inside [0.8, 1.28]; 1.3 clipped at 1.28
    close(m_sym["clip_frac"], 3 / 3)
    close(m_hi["clip_frac"], 2 / 3)
    g = jax.grad(lambda lp: algos.policy_loss(lp, old, adv, mask, clip_high=0.28)[0])(logp)
    close(g, [[-1.25 / 3, 0.0, 0.0, 0.0]])


def test_dual_clip_caps_negative_advantage_loss():
    ratios = np.array([5.0, 2.0, 5.0], np.float32)
    advs = np.array([-1.0, -1.0, 1.0], np.float32)
    logp, old, adv, mask = _batch(ratios, advs)
    loss, m = algos.policy_loss(logp, old, adv, mask, dual_clip=3.0)
    # A<0,r=5: max(5, 1.2) = 5 capped to 3·|A| = 3;  A<0,r=2: 2 < 3 stays;  A>0,r=5: clipped -1.2
    close(loss, (3.0 + 2.0 - 1.2) / 3)
    close(m["dual_clip_frac"], 1 / 3)
    loss_plain, _ = algos.policy_loss(logp, old, adv, mask)
    close(loss_plain, (5.0 + 2.0 - 1.2) / 3)
    g = jax.grad(lambda lp: algos.policy_loss(lp, old, adv, mask, dual_clip=3.0)[0])(logp)
    close(g, [[0.0, 2.0 / 3, 0.0, 0.0]])
    with pytest.raises(ValueError, match="dual_clip"):
        algos.policy_loss(logp, old, adv, mask, dual_clip=1.0)


def test_policy_loss_aggregation_modes():
    # ratio 1 everywhere (on-policy): per-token loss = -A
    adv = jnp.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    mask = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0]])
    z = jnp.zeros((2, 4))
    got = {agg: float(algos.policy_loss(z, z, adv, mask, agg=agg)[0]) for agg in algos.AGGREGATIONS}
    close(got["token-mean"], -11 / 4)
    close(got["seq-mean-token-mean"], -(2 + 5) / 2)
    close(got["seq-mean-token-sum"], -(6 + 5) / 2)
    close(got["seq-mean-token-sum-norm"], -11 / (2 * 4))


# ----------------------------------------------------------------------------------- aggregation

X = jnp.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 9.0, 9.0, 9.0]])
MASK = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize("agg,expected", [
    ("token-mean", 11 / 4),                     # (1+2+3+5) / 4 valid tokens
    ("seq-mean-token-mean", (2 + 5) / 2),        # per-row means 2 and 5; the empty row does not count
    ("seq-mean-token-sum", (6 + 5) / 2),
    ("seq-mean-token-sum-norm", 11 / (2 * 4)),  # / (rows · T)
])
def test_aggregations_on_ragged_mask(agg, expected):
    close(algos.aggregate(X, MASK, agg), expected)


def test_aggregation_overrides_and_microbatch_additivity():
    close(algos.aggregate(X, MASK, "seq-mean-token-sum-norm", norm_len=10), 11 / 20)
    close(algos.aggregate(X, MASK, "token-mean", denom=8), 11 / 8)
    close(algos.aggregate(X, MASK, "seq-mean-token-mean", denom=3), 7 / 3)
    nan_pad = X.at[2].set(jnp.nan)               # NaN in padding never leaks
    close(algos.aggregate(nan_pad, MASK, "token-mean"), 11 / 4)
    for agg, denom in [("token-mean", 4), ("seq-mean-token-mean", 2), ("seq-mean-token-sum", 2)]:
        whole = algos.aggregate(X, MASK, agg)
        parts = sum(algos.aggregate(X[i:i + 1], MASK[i:i + 1], agg, denom=denom) for i in range(3))
        close(parts, whole)


def _old_trainer_weights(agg, lengths, *, global_tokens, global_seqs, max_new_tokens):
    """The trainer's float64 weights before the registry defined them (reference twin, copied verbatim)."""
    lengths = np.maximum(np.asarray(lengths), 1)
    if agg == "token-mean":
        return np.full(len(lengths), 1.0 / max(global_tokens, 1))
    if agg == "seq-mean-token-mean":
        return 1.0 / (max(global_seqs, 1) * lengths)
    if agg == "seq-mean-token-sum":
        return np.full(len(lengths), 1.0 / max(global_seqs, 1))
    if agg == "seq-mean-token-sum-norm":
        return np.full(len(lengths), 1.0 / (max(global_seqs, 1) * max_new_tokens))
    raise ValueError(agg)


@pytest.mark.parametrize("agg", list(algos.AGGREGATIONS))
def test_token_weights_over_denominator_equal_aggregate(agg):
    """One definition per mode: Σ w·x / D (unnormalised weights), Σ folded·x and aggregate(x, mask) agree;
    the folded float64 weights are bit-for-bit the trainer's historical expressions."""
    rng = np.random.default_rng(7)
    lens = np.array([3, 1, 7, 5, 8, 2])
    T = 8
    x = rng.normal(size=(len(lens), T)).astype(np.float32)
    mask = (np.arange(T)[None] < lens[:, None]).astype(np.float32)
    w, which = algos.token_weights(agg, lens, T)
    assert which == algos.AGGREGATIONS[agg].denominator and which in ("tokens", "sequences")
    D = int(lens.sum()) if which == "tokens" else len(lens)
    want = float(algos.aggregate(x, mask, agg, norm_len=T))
    assert float(np.sum(w[:, None] * x * mask)) / D == pytest.approx(want, rel=1e-6)
    folded = algos.folded_token_weights(agg, lens, T, denominator=D)
    assert folded.dtype == np.float64
    assert float(np.sum(folded[:, None] * x * mask)) == pytest.approx(want, rel=1e-6)
    old = _old_trainer_weights(agg, lens, global_tokens=int(lens.sum()), global_seqs=len(lens), max_new_tokens=T)
    assert np.array_equal(folded, old)
    # micro-batch additivity through the weights: any split of the rows sums to the whole
    parts = sum(float(np.sum(w[i:i + 2, None] * x[i:i + 2] * mask[i:i + 2])) for i in range(0, len(lens), 2))
    assert parts / D == pytest.approx(want, rel=1e-6)


def test_register_aggregation_mode():
    with pytest.raises(ValueError, match="already registered"):
        algos.register_aggregation("token-mean", denominator="tokens")(lambda lengths, norm_len: lengths)
    with pytest.raises(ValueError, match="valid choices: tokens, sequences"):
        algos.register_aggregation("_test_bad", denominator="rows")(lambda lengths, norm_len: lengths)
    assert "_test_bad" not in algos.AGGREGATIONS

    @algos.register_aggregation("_test_sqrt_len", denominator="sequences")
    def _sqrt_len(lengths, norm_len):
        """1/G Σ_i Σ_t ℓ_i,t / sqrt|o_i| (a test mode)."""
        return lengths ** 0.5

    try:
        close(algos.aggregate(X, MASK, "_test_sqrt_len"), (6 / np.sqrt(3) + 5) / 2)
        w, which = algos.token_weights("_test_sqrt_len", [3, 1], 4)
        close(w, [1 / np.sqrt(3), 1.0])
        assert which == "sequences"
    finally:
        del algos.AGGREGATIONS["_test_sqrt_len"]


def test_entropy_bonus():
    close(algos.entropy_bonus(X, MASK), 11 / 4)
    close(algos.entropy_bonus(X, MASK, agg="seq-mean-token-mean"), 3.5)


# ------------------------------------------------------------------------------------------- KL


def test_kl_estimator_values():
    logp, ref = jnp.log(jnp.array([[0.5]])), jnp.log(jnp.array([[0.25]]))
    close(algos.kl_penalty(logp, ref, "k1"), [[np.log(2)]])                    # 0.693147
    close(algos.kl_penalty(logp, ref, "k2"), [[0.5 * np.log(2) ** 2]])         # 0.240227
    close(algos.kl_penalty(logp, ref, "k3"), [[0.5 + np.log(2) - 1]])          # 0.193147
    close(algos.kl_penalty(ref, logp, "k1"), [[-np.log(2)]])                   # k1 can be negative
    close(algos.kl_penalty(ref, logp, "k3"), [[2 - np.log(2) - 1]])            # 0.306853


def test_k3_nonnegative_and_zero_when_equal():
    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.normal(size=(16, 32)) * 3, jnp.float32)
    b = jnp.asarray(rng.normal(size=(16, 32)) * 3, jnp.float32)
    for kind in ("k2", "k3"):
        assert float(jnp.min(algos.kl_penalty(a, b, kind))) >= 0.0
    for kind in algos.KL_ESTIMATORS:
        close(algos.kl_penalty(a, a, kind), np.zeros((16, 32)))


def test_kl_mask_keeps_padding_finite_and_kl_loss():
    logp = jnp.array([[np.log(0.5), -200.0]])
    ref = jnp.array([[np.log(0.25), 0.0]])        # exp(200) at the padding slot if it were computed
    mask = jnp.array([[1, 0]])
    close(algos.kl_penalty(logp, ref, "k3", mask=mask), [[0.5 + np.log(2) - 1, 0.0]])
    g = jax.grad(lambda lp: algos.kl_loss(lp, ref, mask, kind="k3"))(logp)
    close(g, [[1 - 0.25 / 0.5, 0.0]])              # d k3 / d logp = 1 - π_ref / π_θ
    g2 = jax.grad(lambda lp: algos.kl_loss(lp, ref, mask, kind="k2"))(logp)
    close(g2, [[np.log(2), 0.0]])


# ---------------------------------------------------------------------------------------- critic


def test_value_loss_clipping():
    old = jnp.array([[1.0, 1.0, 1.0]])
    v = jnp.array([[1.5, 1.5, 1.1]])
    ret = jnp.array([[2.0, 0.0, 2.0]])
    mask = jnp.ones((1, 3))
    loss, m = algos.value_loss(v, old, ret, mask, clip=0.2)
    # tok 0: max(.25, (1.2-2)^2=.64) = .64 (clipped); tok 1: max(2.25, 1.44) = 2.25; tok 2: .81 both
    close(loss, 0.5 * (0.64 + 2.25 + 0.81) / 3)
    close(m["vf_clip_frac"], 1 / 3)
    loss_nc, _ = algos.value_loss(v, old, ret, mask, clip=None)
    close(loss_nc, 0.5 * (0.25 + 2.25 + 0.81) / 3)
    g = jax.grad(lambda x: algos.value_loss(x, old, ret, mask)[0])(v)
    close(g, [[0.0, 1.5 / 3, -0.9 / 3]])            # 0.5 · 2(V-R) / 3; clipped token gets 0


# ------------------------------------------------------------------------------ jit / validation


def test_jit_matches_eager():
    logp, old, adv, mask = _batch(RATIOS, ADVS)
    pl = functools.partial(algos.policy_loss, clip_high=0.28, dual_clip=3.0, agg="seq-mean-token-mean")
    eager, jitted = pl(logp, old, adv, mask), jax.jit(pl)(logp, old, adv, mask)
    close(jitted[0], eager[0])
    for k in eager[1]:
        close(jitted[1][k], eager[1][k])
    # numeric hyper-parameters may be traced
    f = jax.jit(lambda lp, c: algos.policy_loss(lp, old, adv, mask, clip_low=c)[0])
    close(f(logp, 0.2), eager_plain := algos.policy_loss(logp, old, adv, mask)[0])
    assert np.isfinite(eager_plain)

    rewards = jnp.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    for name in ("grpo", "dr_grpo", "rloo"):
        fn = jax.jit(functools.partial(algos.compute_advantages, name))
        close(fn(rewards=rewards, mask=RAGGED8), algos.compute_advantages(name, rewards=rewards, mask=RAGGED8))
    m2 = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]])
    rpp = jax.jit(lambda r, g: algos.reinforce_pp_advantages(r, m2, gamma=g))
    close(rpp(jnp.array([1.0, 0.0]), 0.5), algos.reinforce_pp_advantages(jnp.array([1.0, 0.0]), m2, gamma=0.5))
    gae = jax.jit(algos.gae_advantages, static_argnames=("whiten",))
    r = jnp.ones((2, 4))
    for a, b in zip(gae(r, r * 0.5, m2, gamma=0.9, lam=0.7), algos.gae_advantages(r, r * 0.5, m2, gamma=0.9, lam=0.7)):
        close(a, b)
    vl = jax.jit(algos.value_loss, static_argnames=("agg",))
    close(vl(r, r, r * 2, m2, clip=0.1)[0], algos.value_loss(r, r, r * 2, m2, clip=0.1)[0])
    kl = jax.jit(algos.kl_loss, static_argnames=("kind", "agg"))
    close(kl(r, r * 0.5, m2, kind="k2"), algos.kl_loss(r, r * 0.5, m2, kind="k2"))


def test_shape_and_name_validation():
    z = jnp.zeros((2, 4))
    with pytest.raises(ValueError, match=r"advantages\[2, 3\]"):
        algos.policy_loss(z, z, jnp.zeros((2, 3)), z)
    with pytest.raises(ValueError, match=r"returns\[2, 5\]"):
        algos.value_loss(z, z, jnp.zeros((2, 5)), z)
    with pytest.raises(ValueError, match=r"ref_logp\[4\]"):
        algos.kl_penalty(z, jnp.zeros(4), "k1")
    with pytest.raises(ValueError, match=r"\[P, G\]"):
        algos.grpo_advantages(jnp.zeros(8), jnp.zeros((8, 3)))
    with pytest.raises(ValueError, match="8 rows"):
        algos.grpo_advantages(jnp.zeros((2, 4)), jnp.zeros((7, 3)))
    with pytest.raises(ValueError, match=r"mask must be \[B, T\]"):
        algos.gae_advantages(jnp.zeros(4), jnp.zeros(4), jnp.zeros(4))
    with pytest.raises(ValueError, match="valid choices: .*grpo"):
        algos.compute_advantages("ppo2", rewards=z, mask=z)
    with pytest.raises(ValueError, match="valid choices: k1, k2, k3"):
        algos.kl_penalty(z, z, "k4")
    with pytest.raises(ValueError, match="valid choices: token-mean"):
        algos.policy_loss(z, z, z, z, agg="sum")


def test_registry_decorator():
    with pytest.raises(ValueError, match="already registered"):
        algos.register_advantage("grpo")(lambda **kw: None)

    @algos.register_advantage("_test_const")
    def _const(rewards, mask):
        return jnp.ones_like(mask) * 2.0

    try:
        close(algos.compute_advantages("_test_const", rewards=None, mask=jnp.ones((1, 2))), [[2.0, 2.0]])
    finally:
        del algos.ADVANTAGE_ESTIMATORS["_test_const"]
