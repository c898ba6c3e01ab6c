"""Several processes (jax.distributed on localhost, `scripts/launch_local.sh`) == 1 process: DistFlow's
token repartition, PPO's critic, the disaggregated pools, the all-mechanisms recipes; PPO's resume and its
blockwise backward against the shared 1-process PPO run."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxrl.train import balance
from tests.train_runs import (COMMON, ECHO_TURNS, MODES, PARAM_ATOL_F32, POOLS, PPO, PPO_DEVICES, ROLLOUT_KEYS, ROOT,
                              TAIL, TAIL_KINDS, TINY, WARM_SKEW, _checkpoint_leaves, _env, _finished, _metrics,
                              _one_process, _params, _server, _train, layout, log_tail)


# Settings of the N-process run only. stream_kv_two warms up (every bucket compiled ahead, its local K/V gather
# shapes included), so nothing compiles after step 0 in 2 processes.
MANY_ONLY = {"stream_kv_two": ["trainer.warmup=true"]}


@pytest.mark.processes
@pytest.mark.parametrize("mode", sorted(MODES))
def test_processes_equal_one(tmp_path, tmp_path_factory, mode):
    """N processes == 1, the samples repartitioned by tokens across processes by the DistFlow databuffer before
    packing (trainer.repartition=tokens: samples cross processes on the devices; in the 1-process run the
    repartition is the fast path, nothing to move). four_balanced: 4 processes on tail batching's rounds
    agree on every round's accepted prompts and the queue (the race is decided on lengths, the queue is
    global) and, with DAPO dynamic sampling, on the dropped groups and the waves, and evaluate their shares of
    the held-out prompts to the 1-process run's metrics (jaxrl.eval). ppo_two_balanced: the
    critic, GAE and the reward's KL on 2 processes. stream_four: RollPacker's stream trainer, each of 4
    processes freeing half of its own instances at its own milestones and streaming its own groups'
    gradients there; the early sums meet over processes at the update. stream_kv_two: the same on 2 processes
    with the blockwise backward on the rollout's K/V (each streamed micro-batch's K/V staged on the process's
    freed devices), the 2 processes warmed up: nothing compiles after step 0.
    multiturn_two: 3-turn trajectories, each process stepping its own trajectories' environments (the held-out
    evaluation's too). pat_kv_two:
    PAT on 2 processes, every process switching its own pool at the same decode step on one agreed decision (the
    2 decision records equal), with the blockwise backward on the rollout's K/V the switch migrated."""
    extra, procs, devices = MODES[mode]
    # The two layouts pack sequences into rows differently, so gradient sums differ in float rounding
    # (~1e-9 relative). Adam with eps=1e-8 turns near-zero gradients into ~lr-sized steps (m/sqrt(v) is
    # a sign there), amplifying that noise to ~1e-5; eps=1e-3 (COMMON; the critic's too) keeps the update
    # continuous in the gradient, so "within float tolerance" is what is actually compared.
    one, many = _one_process(tmp_path_factory, extra, devices), tmp_path / "many"
    cmd = [str(ROOT / "scripts" / "launch_local.sh"), str(procs), sys.executable, "-m", "jaxrl.train",
           f"run_dir={many}", *TINY, *COMMON, *extra, *layout(devices, procs), *MANY_ONLY.get(mode, [])]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    (e1, m1), (e2, m2) = [([r for r in rows if "eval/accuracy" in r], [r for r in rows if "reward_mean" in r])
                          for rows in (_metrics(one), _metrics(many))]
    if "eval.split" in " ".join(extra):    # held-out evaluation: each process its share, the same metrics
        assert [r["step"] for r in e1] == [r["step"] for r in e2] == ([0, 2, 3] if "eval.every=2" in extra else [0, 2])
        for k in ("eval/prompts", "eval/accuracy", "eval/len_mean", "eval/samples",
                  *(["eval/pass@2"] if "eval.samples=2" in extra else [])):
            assert [r[k] for r in e2] == pytest.approx([r[k] for r in e1], rel=1e-9), k
    keys = ["reward_mean", "response_len_mean", "response_len_max", "pass_rate", "flow/samples"]
    if "rollout.env" in " ".join(extra):
        keys += ["env/trajectories", "env/turns", "env/turns_max", "env/observation_tokens", "env/prefill_saved"]
        assert all(r["env/turns_max"] == 3 for r in m1)
    if "dynamic_sampling" in " ".join(extra):
        keys += ["tail/long_round", "tail/queue_len", "tail/queued", "tail/prompts_trained", "tail/aborted_responses",
                 "tail/wasted_tokens", "tail/dropped_groups", "tail/waves", "tail/batch_short", "tail/prompts_launched"]
        assert sum(r["tail/dropped_groups"] for r in m1) > 0 and max(r["tail/waves"] for r in m1) == 2
    if mode.endswith("balanced"):
        packed = [r for r in m2 if "flow/padding_local" in r]       # (a step whose groups were all dropped packs nothing)
        assert sum(r["flow/bytes_moved"] for r in packed) > 0
        assert all(r["flow/padding_balanced"] <= r["flow/padding_local"] for r in packed)
    for k in keys:
        assert [r[k] for r in m1] == [r[k] for r in m2], k      # the same rollouts
    if mode.startswith("stream"):      # (counts summed over processes: shrunk = how many pools shrank)
        assert all(r["stream/shrunk"] >= 1 for r in m1 + m2) and sum(r["stream/groups_early"] for r in m2) > 0
        assert "kv" not in mode or all(r["blockwise/blocks"] > 0 for r in m2)
        assert "kv" not in mode or [r["compiles"] for r in m2[1:]] == [0] * (len(m2) - 1)
        assert sum(r["stream/groups_early"] + r["stream/groups_late"] for r in m2) == 2 * 8
        for k in ("loss", "grad_norm", "kl"):
            np.testing.assert_allclose([r[k] for r in m2], [r[k] for r in m1], rtol=1e-5, atol=1e-7, err_msg=k)
    if mode.startswith("pat"):      # one switch per step, decided alike by every process, at the same ticks
        assert all(r["pat/switches"] == 1 and r["pat/max_tp"] == 2 for r in m1 + m2)
        assert all(r["blockwise/blocks"] > 0 for r in m1 + m2)
        recs = [[json.loads(line) for line in (many / name).read_text().splitlines()] for name in
                ["pat_decisions.jsonl"] + [f"pat_decisions.process{k}.jsonl" for k in range(1, procs)]]
        seen = [[(r["rl_step"], r["step"], r["current"], r["tp"], r["switch"]) for r in rs] for rs in recs]
        assert seen[0] and all(x == seen[0] for x in seen)
        assert all(r["actual"]["agreed"]["processes"] == procs for rs in recs for r in rs)
    if mode.startswith("ppo"):     # the critic (weights in the last checkpoint) and the reward's KL agree too
        assert m1[2]["critic/value_mean"] != 0.0 and m1[2]["reward_kl"] > 0 and m1[1]["critic/vf_loss"] > 0
        for k in ("critic/vf_loss", "critic/value_mean", "critic/returns_mean", "reward_kl"):
            assert [r[k] for r in m2] == pytest.approx([r[k] for r in m1], rel=1e-4), k
        for a, b in zip(_checkpoint_leaves(one, "critic"), _checkpoint_leaves(many, "critic")):
            np.testing.assert_allclose(a, b, atol=PARAM_ATOL_F32, rtol=0)
    for a, b in zip(_params(one), _params(many)):
        np.testing.assert_allclose(a, b, atol=PARAM_ATOL_F32, rtol=0)

def test_ppo_resume_restores_the_critic(tmp_path, tmp_path_factory):
    """PPO's run directory resumed from checkpoint 2 (policy, reference and the critic's weights and AdamW
    state) trains step 2 exactly as the uninterrupted run did: the same policy weights bit for bit and the
    same critic metrics (a critic restarted from the policy would give other values and value loss)."""
    one = _one_process(tmp_path_factory, PPO, PPO_DEVICES)
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copy(one / "config.yaml", resumed / "config.yaml")
    shutil.copytree(one / "checkpoints" / "2", resumed / "checkpoints" / "2")
    out = _train(resumed, *COMMON, *PPO, *layout(PPO_DEVICES), "save_every=1")
    assert "resumed" in out.stdout + out.stderr
    want, got = _metrics(one)[2], _metrics(resumed)
    assert len(got) == 1 and got[0]["step"] == 2 and want["critic/value_mean"] != 0.0
    for key in ("reward_mean", "loss", "reward_kl", "critic/vf_loss", "critic/value_mean", "critic/explained_var"):
        assert got[0][key] == want[key], key
    for a, b in zip(_params(one), _params(resumed)):
        np.testing.assert_array_equal(a, b)


def test_ppo_with_the_blockwise_backward_matches_the_full_one(tmp_path, tmp_path_factory):
    """PPO (GAE critic, KL in the reward) with the policy's MetroRLHF blockwise backward (blocks of 16,
    recomputed K/V): the shared full-backward run's rollouts exactly and its policy and critic metrics
    within float32 rounding (the critic keeps the full backward; only the policy's gradient sums differ
    in summation order)."""
    want = _metrics(_one_process(tmp_path_factory, PPO, PPO_DEVICES))
    _train(tmp_path, *COMMON, *PPO, *layout(PPO_DEVICES), "save_every=null", "trainer.backward=blockwise",
           "trainer.block_size=16")
    got = _metrics(tmp_path)
    assert len(got) == len(want)
    for row, ref in zip(got, want):
        assert row["blockwise/blocks"] > 0
        for k in ("reward_mean", "response_len_mean"):
            assert row[k] == ref[k], k
        for k in ("loss", "grad_norm", "reward_kl", "critic/vf_loss", "critic/value_mean"):
            np.testing.assert_allclose(row[k], ref[k], rtol=1e-5, atol=1e-6, err_msg=k)

@pytest.mark.processes
@pytest.mark.parametrize("asynchronous,procs", [(False, 2), (True, 4)], ids=["sync-2-scale_up", "async-4"])
def test_disaggregated_processes_equal_one(tmp_path, monkeypatch, asynchronous, procs):
    """Each of 2 processes gives 2 devices to the shared fsdp=4 train mesh and 2 to its own generation
    instances (each of 4 processes: 1 and 1); the weights reach the instances by the cross-process on-device
    reshard. Same rollouts and, within float tolerance, the same weights as one process with 4 + 4 devices
    (which streams its groups' gradients during the rollout; several processes train after it). sync-2: with
    StreamRL's scale-up, its rule forced due (tests/forced_scale_up.py): each process starts on 1 instance with
    one spare, and one decision for both (T_g, T_t the largest over the processes) grows both to 2 after
    step 0; the 1-process run grows 2 -> 3 -> 4 (tokens do not depend on the instance). async: generation two
    versions ahead (trainer.max_staleness=2) with the decoupled objective on all, each update swapped into the
    next rollout at its 3rd engine step (staged on the train pool's thread, process 1's staging delayed by 1 s:
    tests/delayed_stage.py), the next rollouts' agreements between the processes (key-value store) running
    while the update's device collectives run on the train pool's thread (2 processes:
    tests/test_lora_mechanisms.py's disaggregated async run); on tail batching's rounds with slime's carried
    partial responses: the long round (step 2) resumes on each process responses that others sampled."""
    one, two = tmp_path / "one", tmp_path / "two"
    common = ["steps=3" if asynchronous else "steps=2", "save_every=null", *POOLS, "placement=disaggregated"]
    common += ["trainer.max_staleness=2", "algo.objective=decoupled", "trainer.swap_step=3", *TAIL,
               "rollout.tail_batching.carry_partial=true"] if asynchronous else []
    entry, one_extra, many_extra = ["-m", "jaxrl.train"], [], [f"engine.instances={4 // procs}"]
    if asynchronous:         # process 1's staging of each swapped update is 1 s late
        entry = [str(ROOT / "tests" / "delayed_stage.py")]
    if not asynchronous:
        monkeypatch.setattr(balance, "scale_up_due", lambda t_gen, t_train, k: (True, t_gen - t_train, t_gen / (k + 1)))
        entry = [str(ROOT / "tests" / "forced_scale_up.py")]
        common.append("stage_balance.scale_up=true")
        one_extra = ["engine.instances=2", "stage_balance.max_instances=4"]
        many_extra = ["engine.instances=1", "stage_balance.max_instances=2"]
    _train(one, *common, *one_extra)
    cmd = [str(ROOT / "scripts" / "launch_local.sh"), str(procs), sys.executable, *entry,
           f"run_dir={two}", *TINY, *common, *many_extra]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    m1, m2 = _metrics(one), _metrics(two)
    for key in ROLLOUT_KEYS:
        assert [r[key] for r in m1] == [r[key] for r in m2], key
    assert {r["placement/train_devices"] for r in m2} == {4}
    if asynchronous:         # steps 1 and 2 trained on rollouts of the weights one and two steps behind
        assert {r["placement/gen_devices"] for r in m2} == {1}
        assert [r["placement/staleness"] for r in m2] == [0, 1, 1]      # (rollout 2 made after a swap)
        for key in ("async/lag0_frac", "async/lag1_frac", "async/lag2_frac", "async/swap_step", "tail/long_round",
                    "tail/carried_samples", "tail/carried_tokens", "tail/queue_len"):   # (swapped_sequences: process 0's)
            assert [r[key] for r in m1] == [r[key] for r in m2], key
        assert [r["tail/long_round"] for r in m2] == TAIL_KINDS[:3] and m2[2]["tail/carried_samples"] > 0
        assert max(r["async/gen_wait_s"] for r in m2[:2]) >= 0.5       # process 0's swap waited for process 1
        np.testing.assert_allclose([r["async/is_weight_mean"] for r in m2], [r["async/is_weight_mean"] for r in m1],
                                   rtol=1e-5)
    else:                    # (gen_instances: at the sync, before the step's scale-up)
        assert [r["placement/scaled_up"] for r in m1] == [1, 1] and [r["placement/scaled_up"] for r in m2] == [1, 0]
        assert [r["placement/gen_instances"] for r in m2] == [1, 2]
    for a, b in zip(_params(one), _params(two)):
        np.testing.assert_allclose(a, b, atol=PARAM_ATOL_F32, rtol=0)


@pytest.mark.processes
def test_all_mechanisms_recipes_run(tmp_path):
    """configs/all_mechanisms.yaml (2 processes: tail batching + dynamic sampling, skew placement, the planner,
    the blockwise backward, token repartition, multi-turn trajectories) and its disaggregated one-step-async
    variant, at the tiny size,
    side by side: every mechanism's metrics show that it acted. The length ranker starts from the committed
    quickstart's pairs (its warm start), so skew placement is live from step 0. Beside them the 2-process
    recipe runs again, is killed (SIGKILL, both processes) once checkpoint 2 exists, and its relaunch resumes
    to the uninterrupted run's weights bit for bit; and it runs in 1 process (4 instances on 4 devices): the
    2-process run's rollouts, and its weights within float tolerance (2 processes == 1 for skew placement and
    the planner too, whose equalities are not in test_processes_equal_one: tokens depend on neither the
    instance a prompt is placed on nor the TP). (That the recipe learns is measured at quickstart size by
    scripts/bench_recipes.py, not here.)"""
    two, asy, killed, one = tmp_path / "two", tmp_path / "async", tmp_path / "killed", tmp_path / "one"
    small = [*TINY, "steps=3", "export_hf=false", *WARM_SKEW[1:], *ECHO_TURNS, "optim.eps=1e-3",
             "warm_start.optim.eps=1e-3"]    # (as COMMON: Adam's g / (|g| + eps) would blow rounding up to a step)

    def recipe(run_dir, **kw):
        cmd = [str(ROOT / "scripts" / "launch_local.sh"), "2", sys.executable, "-m", "jaxrl.train", "--config",
               str(ROOT / "configs" / "all_mechanisms.yaml"), f"run_dir={run_dir}", *small, "save_every=1"]
        return subprocess.Popen(cmd, cwd=ROOT, env=_env(), text=True, **kw)

    out = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    procs = [recipe(two, **out),
             subprocess.Popen([sys.executable, "-m", "jaxrl.train", "--config", str(ROOT / "configs" /
                               "all_mechanisms_async.yaml"), f"run_dir={asy}", *small, "save_every=null"],
                              cwd=ROOT, env=_env(), text=True, **out)]
    # the 1-process run in this worker's 4-device run server (no process start of its own), alongside the others
    one_args = ["--config", str(ROOT / "configs" / "all_mechanisms.yaml"), f"run_dir={one}", *small, "save_every=null",
                "distributed.num_processes=1", "engine.instances=4"]
    one_server = _server(one_args)
    one_server.send(one_args)
    victim = recipe(killed, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 900
    while not (killed / "checkpoints" / "2").exists():
        assert victim.poll() is None and time.time() < deadline, "the recipe ended or stalled before step 2 was saved"
        time.sleep(0.2)
    os.killpg(victim.pid, signal.SIGKILL)          # the launcher and both of its processes
    victim.wait()
    for p in procs:
        log = p.communicate(timeout=900)[0]
        assert p.returncode == 0, log_tail(log)
    _finished(one_server.receive(900))
    resumed = recipe(killed, **out)
    log = resumed.communicate(timeout=900)[0]
    assert resumed.returncode == 0 and "resumed" in log, log_tail(log)
    assert [r["step"] for r in _metrics(killed)][-1] == 2
    for key in ("params", "opt_state"):      # (the newest checkpoints: step 3's, the runs' ends)
        for a, b in zip(_checkpoint_leaves(two, key), _checkpoint_leaves(killed, key)):
            np.testing.assert_array_equal(a, b)
    for run in (two, asy):
        rows = _metrics(run)
        assert len(rows) == 3
        assert all(r["tail/waves"] >= 1 and r["tail/prompts_launched"] >= 8 for r in rows)            # tail batching
        assert sum(r["tail/dropped_groups"] for r in rows) > 0                                    # dynamic sampling
        assert all(r["skew/active"] == 1 and r["skew/long_prompts"] > 0 for r in rows)              # skew placement
        assert rows[0]["preemptions"] > 0 and rows[-1]["planner/tp"] == 2                            # the planner
        assert all(r["blockwise/blocks"] > 0 for r in rows if r["flow/samples"])                      # MetroRLHF
        assert all("flow/padding_balanced" in r for r in rows if r["flow/samples"])                   # DistFlow
        assert all(r["env/turns_max"] == 3 and r["env/observation_tokens"] > 0 for r in rows)          # multi-turn
    assert [r["placement/staleness"] for r in _metrics(asy)] == [0, 1, 1]
    for key in ROLLOUT_KEYS + ["tail/prompts_trained", "tail/dropped_groups", "env/observation_tokens"]:
        assert [r[key] for r in _metrics(two)] == [r[key] for r in _metrics(one)], key
    for a, b in zip(_checkpoint_leaves(two, "params"), _checkpoint_leaves(one, "params")):
        np.testing.assert_allclose(a, b, atol=PARAM_ATOL_F32, rtol=0)
