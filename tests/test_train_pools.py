"""Train runs on separate pools and streamed gradients: RollPacker's stream trainer, DAPO's waves streamed,
StreamRL's disaggregated placement (with MetroRLHF's rollout K/V, with PPO), one-step-async: each equal to its
synchronous colocated twin."""

import json

import numpy as np
import pytest

from tests.pat_profiles import forcing_profile
from tests.train_runs import (PARAM_ATOL_F32, POOLS, PPO, ROLLOUT_KEYS, SKEW, TAIL, TAIL_KINDS, WARM_SKEW, _metrics,
                              _params, _same_weights, _train_together)


def test_stream_trainer_step_equals_synchronous(tmp_path):
    """RollPacker's stream trainer in a real run: half the rollout devices are freed at a milestone, groups'
    gradients run there during the rollout, one update at the end — the same rollouts and (within float32
    summation order) the same losses and weights as the synchronous trainer; nothing compiles after step 0.
    With StreamRL's skew placement too (the ranker places step 1; its long-tail instances are capped to the
    ones the shrink keeps, and moved requests stay in their class: tests/test_stream_trainer.py): the same.
    With MetroRLHF's blockwise backward on the rollout's K/V (each streamed micro-batch's K/V staged on the
    freed devices): the same rollouts, and losses and weights within the same tolerance."""
    common = ["steps=2", "save_every=null", "engine.instances=2", "train_layout.fsdp=2", "trainer.micro_batch_tokens=256",
              "optim.eps=1e-3", "warm_start.optim.eps=1e-3", "algo.kl_coef=0.05", "algo.entropy_coef=0.01"]
    skew = [x for x in SKEW if not x.startswith(("engine.instances", "train_layout"))]
    _train_together((tmp_path / "sync", *common),
                    (tmp_path / "stream", *common, "trainer.stream.enabled=true", "trainer.warmup=true"),
                    (tmp_path / "skew", *common, "trainer.stream.enabled=true", *skew),
                    (tmp_path / "kv", *common, "trainer.stream.enabled=true", "trainer.backward=blockwise",
                     "trainer.block_size=48", "trainer.kv_source=rollout"))
    sync = _metrics(tmp_path / "sync")
    for run in ("stream", "skew", "kv"):
        stream = _metrics(tmp_path / run)
        for a, b in zip(sync, stream):
            for key in ("reward_mean", "response_len_mean", "response_len_max"):
                assert a[key] == b[key], key                      # the pool shrink changed no token
            for key in ("loss", "grad_norm", "kl", "entropy"):
                np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-7, err_msg=key)
        assert all(r["stream/shrunk"] == 1 and r["stream/groups_early"] > 0 for r in stream)
        for a, b in zip(_params(tmp_path / "sync"), _params(tmp_path / run)):
            np.testing.assert_allclose(a, b, atol=PARAM_ATOL_F32, rtol=0)
    assert _metrics(tmp_path / "stream")[1]["compiles"] == 0
    assert [r["skew/active"] for r in _metrics(tmp_path / "skew")] == [0, 1]
    assert all(r["blockwise/blocks"] > 0 for r in _metrics(tmp_path / "kv"))

def test_dynamic_sampling_waves_stream_into_one_update(tmp_path):
    """DAPO dynamic sampling's refill waves with the gradients streamed: on a separate train pool (StreamRL's
    pipelining) and with RollPacker's stream trainer. The stream starts once per step and every wave's kept
    groups join it (a wave used to restart it, dropping the earlier waves' groups), and a group the round
    drops (all rewards equal) never enters it: the colocated run's rollouts exactly, and its losses and
    weights within float32 summation order. (The stream trainer frees no devices in a short round: its
    milestones count a round without a race; the groups are held and computed at the end.)"""
    col, dis, st = tmp_path / "col", tmp_path / "dis", tmp_path / "stream"
    common = ["steps=2", "save_every=null", *POOLS, *TAIL, "rollout.tail_batching.dynamic_sampling=true",
              "rollout.tail_batching.max_waves=3"]
    _train_together((col, *common), (dis, *common, "placement=disaggregated"),
                    (st, *common, "trainer.stream.enabled=true"))
    m1, m2, m3 = _metrics(col), _metrics(dis), _metrics(st)
    assert all(r["tail/waves"] == 3 and r["tail/prompts_trained"] > 0 for r in m1)   # groups kept over waves
    for m in (m2, m3):
        for key in ROLLOUT_KEYS + ["tail/prompts_trained", "tail/dropped_groups"]:
            assert [r[key] for r in m1] == [r[key] for r in m], key
        for key in ("loss", "grad_norm"):
            np.testing.assert_allclose([r[key] for r in m], [r[key] for r in m1], rtol=1e-5, atol=1e-7, err_msg=key)
    _same_weights(col, dis, st)


def test_disaggregated_equals_colocated(tmp_path):
    """Dynamic-batch pipelining on a separate train pool: the same rollouts and, after 2 updates, the same
    weights within float tolerance (the streamed micro-batches pack groups in arrival order). With
    MetroRLHF's blockwise backward on the rollout's K/V, streamed too (each streamed micro-batch's K/V staged
    on the train pool from the generation devices as its groups arrive): the same, within the same tolerance
    (measured: weights within 1.2e-7 of the colocated full backward's). With RollPacker's stream trainer too
    (16 prompts a step, so that micro-batches remain after the shrink: half the generation instances are freed
    and their devices join the train pool's stream): the synchronous disaggregated run's rollouts, and its
    losses and weights within the same tolerance."""
    col, dis, kv = tmp_path / "col", tmp_path / "dis", tmp_path / "kv"
    dis16, st = tmp_path / "dis16", tmp_path / "st"
    sixteen = ["steps=2", "save_every=null", *POOLS, "placement=disaggregated", "algo.prompts_per_step=16"]
    _train_together((col, "steps=2", "save_every=null", *POOLS),
                    (dis, "steps=2", "save_every=null", *POOLS, "placement=disaggregated"),
                    (kv, "steps=2", "save_every=null", *POOLS, "placement=disaggregated", "trainer.backward=blockwise",
                     "trainer.block_size=48", "trainer.kv_source=rollout"),
                    (dis16, *sixteen), (st, *sixteen, "trainer.stream.enabled=true"))
    m1, m2, m3 = _metrics(col), _metrics(dis), _metrics(kv)
    for key in ROLLOUT_KEYS:
        assert [r[key] for r in m1] == [r[key] for r in m2] == [r[key] for r in m3], key
    assert all(r["placement/groups_streamed"] > 0 and r["placement/groups"] == 8 for r in m2)
    assert [r["placement/gen_devices"] for r in m2] == [4] * 2 and [r["compiles"] for r in m2][1:] == [0]
    assert all(r["blockwise/blocks"] > 0 and r["placement/groups_streamed"] > 0 for r in m3)
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in m3], [r[key] for r in m1], rtol=1e-5, atol=1e-6, err_msg=key)
    _same_weights(col, dis, kv)
    m5, m6 = _metrics(dis16), _metrics(st)
    for key in ROLLOUT_KEYS:
        assert [r[key] for r in m5] == [r[key] for r in m6], key          # the shrink changed no token
    assert all(r["stream/shrunk"] == 1 and r["stream/freed_devices"] == 2 and r["stream/groups_early"] > 0 for r in m6)
    assert all(r["placement/groups_streamed"] > r["stream/groups_early"] for r in m6)   # the train pool took some
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in m6], [r[key] for r in m5], rtol=1e-5, atol=1e-6, err_msg=key)
    _same_weights(dis16, st)


def test_ppo_on_a_separate_train_pool(tmp_path):
    """PPO (critic, GAE, KL in the reward) with placement=disaggregated trains after the rollout on the train
    pool (GAE needs the whole batch: nothing streams): the colocated run's rollouts exactly and its policy and
    critic metrics and weights within float tolerance. One-step-async PPO (KL as a loss term) runs its critic
    update before the policy's goes to the pool: staleness 0 then 1, the critic learning (values move)."""
    col, dis, asy = tmp_path / "col", tmp_path / "dis", tmp_path / "asy"
    ppo = [*PPO, "save_every=null", *POOLS, "critic.optim.eps=1e-3"]
    no_kl = [x for x in ppo if not x.startswith("algo.kl_in_reward")] + ["algo.kl_in_reward=false"]
    _train_together((col, *ppo), (dis, *ppo, "placement=disaggregated"),
                    (asy, *no_kl, "placement=disaggregated", "trainer.max_staleness=1"))
    m1, m2, m3 = _metrics(col), _metrics(dis), _metrics(asy)
    for key in ROLLOUT_KEYS:
        assert [r[key] for r in m1] == [r[key] for r in m2], key
    assert all("placement/groups_streamed" not in r and r["placement/train_devices"] == 4 for r in m2)
    for key in ("loss", "grad_norm", "reward_kl", "critic/vf_loss", "critic/value_mean", "critic/explained_var"):
        np.testing.assert_allclose([r[key] for r in m2], [r[key] for r in m1], rtol=1e-5, atol=1e-6, err_msg=key)
    for a, b in zip(_params(col), _params(dis)):
        np.testing.assert_allclose(a, b, atol=PARAM_ATOL_F32, rtol=0)
    assert [r["placement/staleness"] for r in m3] == [0, 1, 1]
    assert m3[0]["critic/value_mean"] == 0.0 != m3[2]["critic/value_mean"]
    assert all(np.isfinite(r["critic/vf_loss"]) for r in m3)


def test_one_step_async_with_zero_lr_reproduces_synchronous_rollouts(tmp_path):
    """lr = 0: the weights never move, so the one-step-async rollouts (made on the step-before weights while
    the previous step trains) are the synchronous ones; staleness is 0 at the first step, then exactly 1.
    All three runs use tail batching (its rounds and queue live on the rollout side, so they run one step
    ahead unchanged); the async ones add PAT with skew placement (the ranker warm-started from the
    quickstart's pairs; every rollout starts on the configured TP 1 and switches to TP 4 mid-generation,
    keeping the long/regular classes: tokens depend on neither) or the planner (a KV budget that makes TP 1
    preempt: the layout it picks from rollout n's preemptions is set at rollout n+1's end, so it first serves
    rollout n+2, one rollout later than in a synchronous run)."""
    sync, pat, planner = tmp_path / "sync", tmp_path / "pat", tmp_path / "planner"
    prof = forcing_profile("large")
    prof.key["devices"] = 4
    prof.save(tmp_path / "prof.json")
    common = ["steps=3", "save_every=null", "export_hf=false", "optim.lr=0", *POOLS, "placement=disaggregated", *TAIL]
    _train_together((sync, *common),
                    (pat, *common, "trainer.max_staleness=1", "engine.adaptive_tp.enabled=true",
                     f"engine.adaptive_tp.profile={tmp_path / 'prof.json'}", "engine.adaptive_tp.candidates=[1, 4]",
                     "engine.adaptive_tp.check_every=4", "engine.adaptive_tp.kv=recompute", *WARM_SKEW),
                    (planner, *common, "trainer.max_staleness=1", "engine.planner.enabled=true",
                     "engine.planner.calm_steps=1", "engine.kv_bytes_per_device=3900000"))
    m1, m2, m3 = _metrics(sync), _metrics(pat), _metrics(planner)
    for key in ROLLOUT_KEYS + ["loss", "clip_frac", "tail/long_round", "tail/queue_len", "tail/prompts_trained"]:
        for m in (m2, m3):
            assert [r[key] for r in m1] == pytest.approx([r[key] for r in m], abs=1e-6), key
    assert [r["tail/long_round"] for r in m1] == TAIL_KINDS[:3]
    assert [r["placement/staleness"] for r in m2] == [r["placement/staleness"] for r in m3] == [0, 1, 1]
    assert [r["placement/staleness"] for r in m1] == [0, 0, 0]
    assert [r["pat/switches"] for r in m2] == [1, 1, 1]
    assert all(r["skew/active"] == 1 for r in m2)         # placed by the ranker, classes kept through the switch
    recs = [json.loads(line) for line in (pat / "pat_decisions.jsonl").read_text().splitlines()]
    assert [next(r["current"] for r in recs if r["rl_step"] == s) for s in range(3)] == [1, 1, 1]
    assert [r["preemptions"] > 0 for r in m3] == [True, False, False]    # rollout 1 ran before TP 2 was set
    assert [r["planner/tp"] for r in m3] == [2, 1, 1]
