"""Asynchronous training with bounded staleness (trainer.max_staleness = k) in real runs: generation runs up to k
policy versions ahead of training on disaggregated pools, and the off-policy objectives correct for it."""

import numpy as np

from tests.train_runs import POOLS, ROLLOUT_KEYS, _metrics, _train_together


def test_k_step_staleness_runs_ahead_and_corrects(tmp_path):
    """lr = 0: the weights never move, so k = 2's rollouts (each made while an earlier step trains, on weights
    up to two versions old, each update swapped into the next rollout at its 3rd engine step with the K/V kept)
    are the synchronous run's, token for token; staleness 0, 1, 1, 2 (rollout 2 is made after a swap), the
    tokens after a swap one version younger than those before it (without swaps: 0, 1, 2, 2). With learning, k = 2 trains with AReaL's decoupled objective (the importance
    weight π_prox/π_behav truncated at 2: it moves off 1 once the behaviour weights are older than the proximal
    ones; the swaps recompute the K/V) and with GSPO's sequence ratio (its clip is active on stale samples); no
    step compiles after the first."""
    sync, k2, dec, gspo = tmp_path / "sync", tmp_path / "k2", tmp_path / "dec", tmp_path / "gspo"
    common = ["steps=4", "save_every=null", "export_hf=false", *POOLS, "placement=disaggregated",
              "rewards.fn=tests.dense_reward:score"]
    swap = ["trainer.swap_step=3"]
    _train_together((sync, *common, "optim.lr=0"), (k2, *common, "optim.lr=0", "trainer.max_staleness=2", *swap),
                    (dec, *common, "trainer.max_staleness=2", "algo.objective=decoupled", "optim.lr=3e-3", *swap,
                     "trainer.swap_kv=recompute"),
                    (gspo, *common, "trainer.max_staleness=2", "algo.objective=gspo", "algo.agg=seq-mean-token-mean",
                     "algo.clip_low=3e-4", "algo.clip_high=4e-4", "optim.lr=3e-3"))
    m_sync, m_k2, m_dec, m_gspo = (_metrics(d) for d in (sync, k2, dec, gspo))
    for key in ROLLOUT_KEYS:
        assert [r[key] for r in m_sync] == [r[key] for r in m_k2], key
    for m in (m_k2, m_dec, m_gspo):      # (a swap makes rollout 2, collected after it, one version younger)
        assert [r["placement/staleness"] for r in m] == ([0, 1, 2, 2] if m is m_gspo else [0, 1, 1, 2])
        assert all(r["compiles"] == 0 for r in m[1:])
    for m in (m_k2, m_dec):      # the updates of steps 0 and 1 swap into rollouts 1 and 3; steps 2 and 3 have no
        assert [r["async/swap_step"] for r in m] == [3, 3, 0, 0]      # rollout left to make: they swap between steps
        assert [r["async/swapped_sequences"] > 0 for r in m] == [True, True, False, False]
        lags = [[r[f"async/lag{j}_frac"] for j in range(3)] for r in m]
        assert lags[0] == [1, 0, 0] and lags[2] == [0, 1, 0]         # rollouts 0 and 2: one version each
        assert 0 < lags[1][0] < 1 and lags[1][2] == 0                # rollout 1: version 0, then 1 after the swap
        assert lags[3][0] == 0 and 0 < lags[3][2] < 1                # rollout 3: version 1, then 2
    assert all(r["async/recomputed_positions"] == 0 for r in m_k2)
    assert [r["async/recomputed_positions"] > 0 for r in m_dec] == [True, True, False, False]
    w_mean, w_max = [r["async/is_weight_mean"] for r in m_dec], [r["async/is_weight_max"] for r in m_dec]
    np.testing.assert_allclose(w_mean[0], 1.0, atol=1e-4)          # step 0: behaviour == proximal (f32 rounding)
    assert all(abs(w - 1.0) > 1e-3 for w in w_mean[2:]) and all(w > 1.0 for w in w_max[1:])
    assert all(0.0 <= r["async/is_truncated_frac"] < 0.5 for r in m_dec)
    assert max(r["clip_frac"] for r in m_gspo[1:]) > 0
