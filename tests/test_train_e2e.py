"""End-to-end runs of `python -m jaxrl.train` as real processes (CPU, tiny settings).

- the run directory holds metrics.jsonl, tb/, checkpoints/, hf/;
- kill -9 in the middle of a run, then the same command resumes: final params bit-identical to an
  uninterrupted run;
- 2 processes x 4 devices (jax.distributed on localhost) == 1 process x 8 devices after 2 steps.
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from models import load_hf
from tests.pat_profiles import forcing_profile

ROOT = Path(__file__).resolve().parents[1]
TINY = ["warm_start.steps=3", "warm_start.batch_size=8", "algo.prompts_per_step=8", "algo.group_size=4",
        "rollout.max_new_tokens=12", "data.num_examples=400", "rewards.num_workers=0", "engine.max_batch=32",
        "engine.max_seq_len=128", "data.max_prompt_len=96",
        "trainer.warmup=false"]   # 1-3 step runs use few shapes; the quickstart test below covers the warm-up
PARAM_ATOL_F32 = 1e-5


def _env():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _train(run_dir, *extra, timeout=600, env=None):
    cmd = [sys.executable, "-m", "jaxrl.train", f"run_dir={run_dir}", *TINY, *extra]
    p = subprocess.run(cmd, cwd=ROOT, env={**_env(), **(env or {})}, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def _train_together(*runs, timeout=600):
    """`_train` for each (run_dir, *extra) at once: independent runs overlap their compilations on the cores."""
    procs = [subprocess.Popen([sys.executable, "-m", "jaxrl.train", f"run_dir={d}", *TINY, *extra], cwd=ROOT,
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for d, *extra in runs]
    for p in procs:
        out = p.communicate(timeout=timeout)[0]
        assert p.returncode == 0, out[-6000:]


def _params(run_dir):
    return [np.asarray(x) for x in jax.tree.leaves(load_hf(Path(run_dir) / "hf")[1])]


def _checkpoint_tree(run_dir):
    """A run's newest checkpoint state as saved (nested dicts of numpy arrays)."""
    import orbax.checkpoint as ocp

    step = max(int(p.name) for p in (Path(run_dir) / "checkpoints").iterdir() if p.name.isdigit())
    path = Path(run_dir) / "checkpoints" / str(step) / "state"
    ckpt = ocp.PyTreeCheckpointer()
    tree = ckpt.metadata(path)
    tree = getattr(tree, "item_metadata", tree)
    tree = getattr(tree, "tree", tree)
    return ckpt.restore(path, restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree))


def _checkpoint_leaves(run_dir, key):
    """The arrays of `key` (e.g. "critic": its params and AdamW state) in a run's newest checkpoint."""
    return jax.tree.leaves(_checkpoint_tree(run_dir)[key])


def _same_weights(ref, *runs):
    """Each run's final weights equal `ref`'s within PARAM_ATOL_F32."""
    want = _params(ref)
    for run in runs:
        for a, b in zip(want, _params(run)):
            np.testing.assert_allclose(a, b, atol=PARAM_ATOL_F32, rtol=0)


def _metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_run_dir_contents(tmp_path):
    """The run directory's files; and the default graph (`jaxrl.flow`, with its reference node) reproduces
    the hand-ordered trainer it replaced bit for bit: the same per-step metrics (timings aside) and the same
    final weights as tests/golden/flow_default.json, recorded with the pre-DistFlow trainer."""
    _train(tmp_path, "steps=2", "save_every=1", "profile_steps=1:2", "algo.kl_coef=0.05")   # + reference policy
    rows = _metrics(tmp_path)
    golden = json.loads((ROOT / "tests" / "golden" / "flow_default.json").read_text())
    for row, want in zip(rows, golden["steps"], strict=True):
        assert {k: row.get(k) for k in want} == want
    digest = hashlib.sha256(b"".join(a.tobytes() for a in _params(tmp_path))).hexdigest()
    assert digest == golden["params_sha256"]
    assert [r["flow/samples"] for r in rows] == [32, 32]
    assert [r["step"] for r in rows] == [0, 1]
    assert abs(rows[0]["kl"]) < 1e-9 and rows[1]["kl"] > 1e3 * max(abs(rows[0]["kl"]), 1e-13)  # ref == policy, then KL grows
    for key in ("reward_mean", "response_len_mean", "response_len_max", "step_seconds", "pass_rate", "kl",
                "entropy", "clip_frac", "grad_norm", "lr", "tokens_per_s", "rollout_s", "train_s", "compiles", "compile_s"):
        assert key in rows[0]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert list((tmp_path / "tb" / "plugins" / "profile").rglob("*.xplane.pb"))
    assert (tmp_path / "hf" / "config.json").exists() and (tmp_path / "config.yaml").exists()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["0", "1", "2"]


MY_NODES = '''
import numpy as np

def keep_top_variance(ctx, data, groups: int = 1):
    """Keep this process's `groups` prompt groups whose rewards vary most (ties: the first ones)."""
    r = np.asarray(data.rewards).reshape(-1, data.group_size)
    best = set(np.argsort(-r.std(axis=1), kind="stable")[:groups].tolist())
    data.keep_groups([g in best for g in range(data.groups)])
    data.metrics["my/kept_groups"] = len(best)
'''
MY_GRAPH = '''
name: grpo_top_variance
nodes:
  - {id: rollout,   role: actor,     type: model_inference}
  - {id: reward,    role: reward,    type: compute,     deps: [rollout], stream: [rollout]}
  - {id: pick,      role: filter,    type: compute,     deps: [reward], fn: "my_nodes:keep_top_variance",
     options: {groups: 1}}
  - {id: advantage, role: advantage, type: compute,     deps: [pick]}
  - {id: update,    role: actor,     type: model_train, deps: [advantage]}
'''


def test_custom_graph_node_by_import_path(tmp_path):
    """A user's graph with a node loaded by import path (the README's example): it keeps one group of the
    step's 8, so the update trains on 4 samples instead of 32; the rollout metrics still cover all 32."""
    (tmp_path / "my_nodes.py").write_text(MY_NODES)
    (tmp_path / "my_graph.yaml").write_text(MY_GRAPH)
    _train(tmp_path / "run", "steps=1", "save_every=null", "export_hf=false",
           f"algo.graph={tmp_path / 'my_graph.yaml'}", env={"PYTHONPATH": str(tmp_path)})
    row = _metrics(tmp_path / "run")[0]
    assert (row["flow/samples"], row["my/kept_groups"]) == (4, 1)
    assert row["reward/items"] == 32


# Tail batching (RollPacker) with eta_prompts 1.5: 12 prompts drawn, 8 trained, 4 queued per short round, so
# steps 0, 1 are short rounds, step 2 a long one (the 8 queued prompts), step 3 short again.
TAIL = ["rollout.tail_batching.enabled=true", "rollout.tail_batching.eta_prompts=1.5"]
TAIL_KINDS = [0, 0, 1, 0]


# StreamRL: 4 generation devices beside a 4-device train mesh; 2-row micro-batches so groups stream during the
# rollout. The colocated twin runs the same instances and train layout on 4 shared devices.
POOLS = ["engine.instances=4", "train_layout.fsdp=4", "trainer.micro_batch_tokens=256", "optim.eps=1e-3",
         "warm_start.optim.eps=1e-3"]
ROLLOUT_KEYS = ["reward_mean", "response_len_mean", "response_len_max", "pass_rate"]

# StreamRL skew-aware placement over 4 instances, the length ranker refreshed every step (tiny sizes).
SKEW = ["rollout.skew.enabled=true", "engine.instances=4", "train_layout.fsdp=4", "rollout.skew.ranker.train_steps=20",
        "rollout.skew.ranker.refresh_every=1",
        "rollout.skew.ranker.d_model=32", "rollout.skew.ranker.batch=16"]


def kill_and_resume(full, killed, args):
    """`args` run uninterrupted in `full` and, alongside (two processes: both cores compile), in `killed`, which
    is killed (SIGKILL) once checkpoint 2 exists and then resumed by the same command: the final weights must
    be bit-identical."""
    cmd = [sys.executable, "-m", "jaxrl.train", *TINY, *args]
    whole = subprocess.Popen([*cmd, f"run_dir={full}"], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    p = subprocess.Popen([*cmd, f"run_dir={killed}"], cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while not (killed / "checkpoints" / "2").exists():
        assert p.poll() is None and time.time() < deadline, "run ended or stalled before step 2 was saved"
        time.sleep(0.2)
    p.send_signal(signal.SIGKILL)
    p.wait()
    log = whole.communicate(timeout=600)[0]
    assert whole.returncode == 0, log[-3000:]
    assert not (killed / "hf").exists()
    out = _train(killed, *args)
    assert "resumed" in out.stdout + out.stderr
    for a, b in zip(_params(full), _params(killed)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("tail", [1, 2, 3], ids=["tail_batching", "skew", "async"])
def test_kill_and_resume_is_bit_identical(tmp_path, tail):
    """Killed after checkpoint 2 (with tail batching: a queue of 8 prompts in it; with skew placement: the
    length ranker and its history; one-step-async, with tail batching: the rollout of step 3 (a short
    round planned after the long one), made on step 1's weights),
    resumed: the same final weights and per-step metrics as an uninterrupted run. (A plain synchronous run
    is not killed separately: tail batching's run is the synchronous chain of graph nodes plus its queue.)"""
    full, killed = tmp_path / "full", tmp_path / "killed"
    args = ["steps=4", "save_every=1"] + TAIL * (tail in (1, 3)) + SKEW * (tail == 2) + (
        POOLS + ["placement=disaggregated", "trainer.async_steps=1"]) * (tail == 3)
    kill_and_resume(full, killed, args)
    assert [r["reward_mean"] for r in _metrics(full)] == [r["reward_mean"] for r in _metrics(killed)]
    if tail == 2:         # the resumed ranker trains and ranks as the uninterrupted one did
        rows = _metrics(killed)
        assert [r["skew/active"] for r in rows] == [0, 1, 1, 1] and [r["skew/pairs"] for r in rows] == [8, 16, 24, 32]
        for key in ("skew/loss", "skew/kendall_tau", "skew/long_instances", "skew/predicted_s"):
            assert [r.get(key) for r in _metrics(full)] == [r.get(key) for r in rows], key
        assert len((killed / "length_pairs.jsonl").read_text().splitlines()) >= 32
    if tail in (1, 3):    # (async: the queue and the round plan of the prefetched rollout are in the checkpoint)
        rows = _metrics(killed)
        assert [r["tail/long_round"] for r in rows] == TAIL_KINDS and rows[1]["tail/queue_len"] == 8
        for key in ("tail/queue_len", "tail/aborted_responses", "tail/wasted_tokens", "response_len_max"):
            assert [r[key] for r in _metrics(full)] == [r[key] for r in rows], key


DYNAMIC = ["rollout.tail_batching.dynamic_sampling=true", "rollout.tail_batching.max_waves=2"]
# Skew placement live from step 0: the length ranker warm-started from the committed quickstart's pairs.
WARM_SKEW = ["rollout.skew.enabled=true", "rollout.skew.ranker.train_steps=20", "rollout.skew.ranker.d_model=32",
             "rollout.skew.ranker.batch=16",
             f"rollout.skew.ranker.pairs={ROOT / 'scripts' / 'results' / 'quickstart_length_pairs.jsonl'}"]


# 1 process vs N: (extra settings, N). Dynamic sampling runs on tail batching's rounds (steps 0, 1 short, step 2
# the long round), so it covers both mechanisms' global agreement.
# PPO (the `ppo` graph): a critic, GAE, the KL to the reference in the token rewards (node reward_kl), and a
# dense reward (the tiny policy's 0/1 rewards would be ~all 0: advantages of float noise). Step 0 has no KL
# yet (policy == reference) and the critic's first values are 0, so step 2 is the first where all of it is
# live. The 1-process runs save every step: test_ppo_resume_restores_the_critic resumes from checkpoint 2.
PPO = ["algo.advantage=gae", "algo.kl_coef=0.05", "algo.kl_in_reward=true", "steps=3",
       "rewards.fn=tests.dense_reward:score"]
# GRPO: 4 processes on tail batching's rounds with DAPO dynamic sampling (the plain synchronous chain is the
# same chain of nodes), repartitioned by tokens; PPO on 2 processes, also repartitioned. Each shares its
# 1-process run. (Local packing without the repartition across processes: test_disaggregated_two_processes.)
MODES = {"four_balanced": (TAIL + ["steps=3"] + DYNAMIC + ["trainer.repartition=tokens"], 4),
         "ppo_two_balanced": (PPO + ["trainer.repartition=tokens"], 2)}
COMMON = ["steps=2", "save_every=null", "train_layout.fsdp=8", "optim.eps=1e-3", "warm_start.optim.eps=1e-3",
          "critic.optim.eps=1e-3"]
_ONE_PROCESS_RUNS = {}


def _one_process(tmp_path_factory, extra):
    """The 1-process x 8-device run of `COMMON + extra` (without the repartition, which has nothing to move
    in one process), run once per session and shared by the tests that compare against it."""
    key = tuple(COMMON + [x for x in extra if x != "trainer.repartition=tokens"])
    if key not in _ONE_PROCESS_RUNS:
        _ONE_PROCESS_RUNS[key] = tmp_path_factory.mktemp("one")
        _train(_ONE_PROCESS_RUNS[key], *key, "engine.instances=8", "save_every=1")
    return _ONE_PROCESS_RUNS[key]


@pytest.mark.processes
@pytest.mark.parametrize("mode", sorted(MODES))
def test_processes_equal_one(tmp_path, tmp_path_factory, mode):
    """N processes == 1, the samples repartitioned by tokens across processes by the DistFlow databuffer before
    packing (trainer.repartition=tokens: samples cross processes on the devices; in the 1-process run the
    repartition is the fast path, nothing to move). four_balanced: 4 processes on tail batching's rounds
    agree on every round's accepted prompts and the queue (the race is decided on lengths, the queue is
    global) and, with DAPO dynamic sampling, on the dropped groups and the waves. ppo_two_balanced: the
    critic, GAE and the reward's KL on 2 processes."""
    extra, procs = MODES[mode]
    # The two layouts pack sequences into rows differently, so gradient sums differ in float rounding
    # (~1e-9 relative). Adam with eps=1e-8 turns near-zero gradients into ~lr-sized steps (m/sqrt(v) is
    # a sign there), amplifying that noise to ~1e-5; eps=1e-3 (COMMON; the critic's too) keeps the update
    # continuous in the gradient, so "within float tolerance" is what is actually compared.
    one, many = _one_process(tmp_path_factory, extra), tmp_path / "many"
    cmd = [str(ROOT / "scripts" / "launch_local.sh"), str(procs), sys.executable, "-m", "jaxrl.train",
           f"run_dir={many}", *TINY, *COMMON, *extra, f"engine.instances={8 // procs}"]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    m1, m2 = _metrics(one), _metrics(many)
    keys = ["reward_mean", "response_len_mean", "response_len_max", "pass_rate", "flow/samples"]
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
    if mode.startswith("ppo"):     # the critic (weights in the last checkpoint) and the reward's KL agree too
        assert m1[2]["critic/value_mean"] != 0.0 and m1[2]["reward_kl"] > 0 and m1[1]["critic/vf_loss"] > 0
        for k in ("critic/vf_loss", "critic/value_mean", "critic/returns_mean", "reward_kl"):
            assert [r[k] for r in m2] == pytest.approx([r[k] for r in m1], rel=1e-4), k
        for a, b in zip(_checkpoint_leaves(one, "critic"), _checkpoint_leaves(many, "critic")):
            np.testing.assert_allclose(a, b, atol=PARAM_ATOL_F32, rtol=0)
    for a, b in zip(_params(one), _params(many)):
        np.testing.assert_allclose(a, b, atol=PARAM_ATOL_F32, rtol=0)


def test_ppo_learns_on_the_quickstart_task(tmp_path):
    """The `ppo` graph on the quickstart recipe (its warm start, task mix and 0/1 rewards; 16 prompts a step,
    40 steps): the reward rises and the critic learns to predict the returns. Measured: mean reward 0.121
    over steps 0-9 -> 0.161 over steps 30-39; the full 250-step quickstart in the README."""
    cmd = [sys.executable, "-m", "jaxrl.train", f"run_dir={tmp_path}", "algo.advantage=gae", "steps=40",
           "algo.prompts_per_step=16", "save_every=null", "export_hf=false"]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = _metrics(tmp_path)
    first, last = rows[:10], rows[-10:]
    mean = lambda rs, k: float(np.mean([r[k] for r in rs]))
    assert mean(last, "reward_mean") > mean(first, "reward_mean") + 0.03
    assert mean(last, "critic/explained_var") > 0.1 > mean(first, "critic/explained_var")
    assert sum(r["compiles"] for r in rows[1:]) == 0           # nothing compiled after the first step


def test_ppo_resume_restores_the_critic(tmp_path, tmp_path_factory):
    """PPO's run directory resumed from checkpoint 2 (policy, reference and the critic's weights and AdamW
    state) trains step 2 exactly as the uninterrupted run did: the same policy weights bit for bit and the
    same critic metrics (a critic restarted from the policy would give other values and value loss)."""
    one = _one_process(tmp_path_factory, PPO)
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copy(one / "config.yaml", resumed / "config.yaml")
    shutil.copytree(one / "checkpoints" / "2", resumed / "checkpoints" / "2")
    out = _train(resumed, *COMMON, *PPO, "engine.instances=8", "save_every=1")
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
    want = _metrics(_one_process(tmp_path_factory, PPO))
    _train(tmp_path, *COMMON, *PPO, "engine.instances=8", "save_every=null", "trainer.backward=blockwise",
           "trainer.block_size=16")
    got = _metrics(tmp_path)
    assert len(got) == len(want)
    for row, ref in zip(got, want):
        assert row["blockwise/blocks"] > 0
        for k in ("reward_mean", "response_len_mean"):
            assert row[k] == ref[k], k
        for k in ("loss", "grad_norm", "reward_kl", "critic/vf_loss", "critic/value_mean"):
            np.testing.assert_allclose(row[k], ref[k], rtol=1e-5, atol=1e-6, err_msg=k)


BACKWARD = {"full": [],
            # MetroRLHF, blocks of 48 over 160-token rows (padded to 192): the same metrics as the full backward.
            # With the rollout's K/V (the path with the most parts: export, staging, packed gather); the
            # recompute source's gradients == grad_step are tested in test_blockwise.py, not run here again.
            "blockwise-rollout": ["trainer.backward=blockwise", "trainer.block_size=48", "trainer.kv_source=rollout"]}


@pytest.mark.parametrize("backward", sorted(BACKWARD))
def test_quickstart_metrics_unchanged(tmp_path, backward):
    """The quickstart recipe, shortened, reproduces the per-step metrics recorded before the movable-state
    refactor (tests/golden/quickstart_short.json): same seed -> the same rollouts and rewards exactly, the
    same losses within float32 rounding; and after its warm-up it compiles nothing (a ragged workload:
    response lengths vary step to step). With trainer.backward=blockwise too (rollout K/V), which
    also reports the blocks it ran."""
    golden = json.loads((ROOT / "tests" / "golden" / "quickstart_short.json").read_text())
    cmd = [sys.executable, "-m", "jaxrl.train", f"run_dir={tmp_path}", "steps=6", "warm_start.steps=10",
           "save_every=null", "export_hf=false", *BACKWARD[backward]]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = _metrics(tmp_path)
    assert len(rows) == len(golden["steps"])
    exact = ("reward_mean", "pass_rate", "response_len_mean", "response_len_max")     # the same rollouts
    for step, (row, want) in enumerate(zip(rows, golden["steps"])):
        assert {k: row[k] for k in exact} == {k: want[k] for k in exact}, step
        # Fixed-shape micro-batches sum the gradient in another order than the recorded whole-batch step:
        # float32 rounding (measured: loss within 5e-8, grad_norm within 1.1e-7 relative; blockwise: loss
        # within 2.1e-6, grad_norm 1.7e-7).
        for k in sorted(set(want) - set(exact)):
            np.testing.assert_allclose(row[k], want[k], rtol=1e-5, atol=1e-6, err_msg=f"step {step} {k}")
        if step:      # bounded shapes: everything was compiled by the warm-up before step 0 finished
            assert row["compiles"] == 0, (step, row["compiles"])
        assert (row.get("blockwise/blocks", 0) > 0) == (backward != "full")


def test_planner_raises_and_lowers_tp(tmp_path):
    """RollPacker's planner in a run whose KV budget makes TP1 preempt: TP goes 1 -> 2 after the preempting
    step, back to 1 after a calm one (calm_steps=1), and up again; the layout rides on the weight sync."""
    _train(tmp_path, "steps=3", "save_every=null", "export_hf=false", "engine.planner.enabled=true",
           "engine.planner.calm_steps=1", "engine.instances=2", "train_layout.fsdp=2",
           "engine.kv_bytes_per_device=3900000")       # tiny-char: 3.2 MB of weights + ~20 pages at TP1, ~138 at TP2
    rows = _metrics(tmp_path)
    assert [r["planner/tp"] for r in rows] == [2, 1, 2]
    assert [r["preemptions"] > 0 for r in rows] == [True, False, True]
    assert [r["planner/instances"] for r in rows] == [1, 2, 1]


def test_stream_trainer_step_equals_synchronous(tmp_path):
    """RollPacker's stream trainer in a real run: half the rollout devices are freed at a milestone, groups'
    gradients run there during the rollout, one update at the end — the same rollouts and (within float32
    summation order) the same losses and weights as the synchronous trainer; nothing compiles after step 0.
    With StreamRL's skew placement too (the ranker places step 1; its long-tail instances are capped to the
    ones the shrink keeps, and moved requests stay in their class: tests/test_stream_trainer.py): the same."""
    common = ["steps=2", "save_every=null", "engine.instances=2", "train_layout.fsdp=2", "trainer.micro_batch_tokens=256",
              "optim.eps=1e-3", "warm_start.optim.eps=1e-3", "algo.kl_coef=0.05", "algo.entropy_coef=0.01"]
    skew = [x for x in SKEW if not x.startswith(("engine.instances", "train_layout"))]
    _train_together((tmp_path / "sync", *common),
                    (tmp_path / "stream", *common, "trainer.stream.enabled=true", "trainer.warmup=true"),
                    (tmp_path / "skew", *common, "trainer.stream.enabled=true", *skew))
    sync = _metrics(tmp_path / "sync")
    for run in ("stream", "skew"):
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


def test_dynamic_sampling_with_no_signal_trains_nothing(tmp_path):
    """A reward that is the same for every response: dynamic sampling drops every group, so after the
    warm start the weights never move and each step reports the whole batch short."""
    warm, run = tmp_path / "warm", tmp_path / "run"
    const = ["rewards.fn=tests.test_dynamic_sampling:constant_reward", "steps=2", "save_every=null"]
    _train_together((warm, "steps=0"), (run, *TAIL, *DYNAMIC, *const))
    for a, b in zip(_params(warm), _params(run)):
        np.testing.assert_array_equal(a, b)
    rows = _metrics(run)
    assert [r["tail/batch_short"] for r in rows] == [8, 8] and all(r["tail/prompts_trained"] == 0 for r in rows)
    assert all(r["tail/dropped_groups"] == r["tail/prompts_launched"] == 24 for r in rows)



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
    MetroRLHF's blockwise backward on the rollout's K/V the train pool trains after the rollout (the K/V
    are staged for the whole batch, moved from the generation devices): the same, within the same tolerance
    (measured: weights within 1.2e-7 of the colocated full backward's)."""
    col, dis, kv = tmp_path / "col", tmp_path / "dis", tmp_path / "kv"
    _train_together((col, "steps=2", "save_every=null", *POOLS),
                    (dis, "steps=2", "save_every=null", *POOLS, "placement=disaggregated"),
                    (kv, "steps=2", "save_every=null", *POOLS, "placement=disaggregated", "trainer.backward=blockwise",
                     "trainer.block_size=48", "trainer.kv_source=rollout"))
    m1, m2, m3 = _metrics(col), _metrics(dis), _metrics(kv)
    for key in ROLLOUT_KEYS:
        assert [r[key] for r in m1] == [r[key] for r in m2] == [r[key] for r in m3], key
    assert all(r["placement/groups_streamed"] > 0 and r["placement/groups"] == 8 for r in m2)
    assert [r["placement/gen_devices"] for r in m2] == [4] * 2 and [r["compiles"] for r in m2][1:] == [0]
    assert all(r["blockwise/blocks"] > 0 and "placement/groups" not in r for r in m3)
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in m3], [r[key] for r in m1], rtol=1e-5, atol=1e-6, err_msg=key)
    _same_weights(col, dis, kv)


def test_ppo_on_a_separate_train_pool(tmp_path):
    """PPO (critic, GAE, KL in the reward) with placement=disaggregated trains after the rollout on the train
    pool (GAE needs the whole batch: nothing streams): the colocated run's rollouts exactly and its policy and
    critic metrics and weights within float tolerance. One-step-async PPO (KL as a loss term) runs its critic
    update before the policy's goes to the pool: staleness 0 then 1, the critic learning (values move)."""
    col, dis, asy = tmp_path / "col", tmp_path / "dis", tmp_path / "asy"
    ppo = [*PPO, "save_every=null", *POOLS, "critic.optim.eps=1e-3"]
    no_kl = [x for x in ppo if not x.startswith("algo.kl_in_reward")] + ["algo.kl_in_reward=false"]
    _train_together((col, *ppo), (dis, *ppo, "placement=disaggregated"),
                    (asy, *no_kl, "placement=disaggregated", "trainer.async_steps=1"))
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
                    (pat, *common, "trainer.async_steps=1", "engine.adaptive_tp.enabled=true",
                     f"engine.adaptive_tp.profile={tmp_path / 'prof.json'}", "engine.adaptive_tp.candidates=[1, 4]",
                     "engine.adaptive_tp.check_every=4", "engine.adaptive_tp.kv=recompute", *WARM_SKEW),
                    (planner, *common, "trainer.async_steps=1", "engine.planner.enabled=true",
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


@pytest.mark.processes
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_disaggregated_two_processes_equal_one(tmp_path, asynchronous):
    """Each of 2 processes gives 2 devices to the shared fsdp=4 train mesh and 2 to its own generation
    instances; the weights reach the instances by the cross-process on-device reshard. Same rollouts and,
    within float tolerance, the same weights as one process with 4 + 4 devices (which streams its groups'
    gradients during the rollout; two processes train after it). async: one-step-async on both, the next
    rollout's agreements between the processes (key-value store) running while the update's device
    collectives run on the train pool's thread."""
    one, two = tmp_path / "one", tmp_path / "two"
    common = ["steps=2", "save_every=null", *POOLS, "placement=disaggregated",
              f"trainer.async_steps={int(asynchronous)}"]
    _train(one, *common)
    cmd = [str(ROOT / "scripts" / "launch_local.sh"), "2", sys.executable, "-m", "jaxrl.train", f"run_dir={two}",
           *TINY, *common, "engine.instances=2"]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    m1, m2 = _metrics(one), _metrics(two)
    for key in ROLLOUT_KEYS:
        assert [r[key] for r in m1] == [r[key] for r in m2], key
    assert {r["placement/train_devices"] for r in m2} == {4} and {r["placement/gen_devices"] for r in m2} == {2}
    if asynchronous:         # step 1 trained on a rollout of the weights one step behind
        assert [r["placement/staleness"] for r in m2] == [0, 1]
    for a, b in zip(_params(one), _params(two)):
        np.testing.assert_allclose(a, b, atol=PARAM_ATOL_F32, rtol=0)


@pytest.mark.processes
def test_all_mechanisms_recipes_run(tmp_path):
    """configs/all_mechanisms.yaml (2 processes: tail batching + dynamic sampling, skew placement, the planner,
    the blockwise backward, token repartition) and its disaggregated one-step-async variant, at the tiny size,
    side by side: every mechanism's metrics show that it acted. The length ranker starts from the committed
    quickstart's pairs (its warm start), so skew placement is live from step 0. (That the recipe learns is
    measured at quickstart size by scripts/bench_recipes.py, not here.)"""
    two, asy = tmp_path / "two", tmp_path / "async"
    small = [*TINY, "steps=3", "save_every=null", "export_hf=false", *WARM_SKEW[1:]]
    procs = [subprocess.Popen([str(ROOT / "scripts" / "launch_local.sh"), "2", sys.executable, "-m", "jaxrl.train",
                               "--config", str(ROOT / "configs" / "all_mechanisms.yaml"), f"run_dir={two}", *small],
                              cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
             subprocess.Popen([sys.executable, "-m", "jaxrl.train", "--config",
                               str(ROOT / "configs" / "all_mechanisms_async.yaml"), f"run_dir={asy}", *small],
                              cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    for p in procs:
        out = p.communicate(timeout=900)[0]
        assert p.returncode == 0, out[-6000:]
    for run in (two, asy):
        rows = _metrics(run)
        assert len(rows) == 3
        assert all(r["tail/waves"] >= 1 and r["tail/prompts_launched"] >= 8 for r in rows)            # tail batching
        assert sum(r["tail/dropped_groups"] for r in rows) > 0                                    # dynamic sampling
        assert all(r["skew/active"] == 1 and r["skew/long_prompts"] > 0 for r in rows)              # skew placement
        assert rows[0]["preemptions"] > 0 and rows[-1]["planner/tp"] == 2                            # the planner
        assert all(r["blockwise/blocks"] > 0 for r in rows if r["flow/samples"])                      # MetroRLHF
        assert all("flow/padding_balanced" in r for r in rows if r["flow/samples"])                   # DistFlow
    assert [r["placement/staleness"] for r in _metrics(asy)] == [0, 1, 1]
