"""End-to-end runs of `python -m jaxrl.train` (CPU, tiny settings; in the test worker's process, see
tests/train_runs.py): the run directory (metrics.jsonl, tb/, checkpoints/, hf/) and the default graph against
its golden record, a user's graph node, the quickstart recipe against its golden metrics, the planner, and
dynamic sampling with no signal; PPO learning on the quickstart task. Kill -9 and resume: test_train_resume.py; several processes:
test_train_processes.py; separate pools, the stream trainer, one-step-async: test_train_pools.py."""

import hashlib
import json

import numpy as np
import pytest

from tests.train_runs import (DEFAULT_OPT, DYNAMIC, FEWER_SHAPES, GOLDEN_OPT, NOISE_ATOL, ROOT, TAIL, _metrics, _params,
                              _train, _train_together, run_main)


# tests/golden/flow_default.json's metrics on a CPU it has no exact record for: XLA:CPU compiles for the host's
# instruction set (AVX2 and FMA on an AMD EPYC; AVX-512 on a Xeon) and blocks its matmuls by the cache sizes, so
# float32 sums round differently. Measured on a Xeon against the first EPYC's record: entropy within 4.8e-6
# relative, step 1's grad_norm 1.2e-5; step 0 has no reward signal (every advantage 0), so its loss, KL and
# gradient are rounding noise, 0.0 on the Xeon and ~1e-9 on the EPYCs, and step 1's KL follows from that noise
# (5.8e-9 vs 3.3e-16). Counts, rewards and lengths are exact on all: the same tokens were sampled. Two EPYCs of one
# model name round differently (grad_norm 1.2789e-09 vs 1.2261e-09 at step 0): the exact records key on
# `cpu_id()` (family/model, caches, ISA), never on the name alone.
CROSS_CPU_RTOL = 2e-5


def _this_cpu() -> str:
    from jaxrl.train.summary import cpu_id

    return cpu_id()


def test_run_dir_contents(tmp_path):
    """The run directory's files; and the default graph (`jaxrl.flow`, with its reference node) reproduces
    the hand-ordered trainer it replaced: on a CPU where tests/golden/flow_default.json has an `exact` record
    (the pre-DistFlow trainer's run there, keyed by `cpu_id()`), the same per-step metrics (timings aside) and
    the same final weights bit for bit; on any other, the first record's counts, rewards and lengths exactly
    and its float metrics within CROSS_CPU_RTOL."""
    held = tmp_path / "held.jsonl"       # held-out evaluation before each step and after the last (jaxrl.eval)
    held.write_text("".join(json.dumps({"prompt": p, "answer": a, "task": t}) + "\n" for p, a, t in
                            [("copy abc", "abc", "copy"), ("rev hello", "olleh", "reverse"), ("add 3+4", "7", "add")]))
    _train(tmp_path, "steps=2", "save_every=1", "profile_steps=1:2", "algo.kl_coef=0.05",   # + reference policy
           "curves=true", f"eval.data={held}", "eval.every=1", "eval.samples=2", env=GOLDEN_OPT)  # (golden's settings)
    everything = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["eval/prompts"], "reward_mean" in r) for r in everything] == [(0, 3, True), (1, 3, True),
                                                                                        (2, 3, False)]
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["kind"]) for s in samples if s["kind"] != "train"] == [
        (step, kind) for step in range(3) for kind in ("eval_worst", "eval_worst", "eval_best", "eval_best")]
    train_samples = [s for s in samples if s["kind"] == "train"]
    assert [s["step"] for s in train_samples] == [0] * 4 + [1] * 4 and all(s["completion"] for s in train_samples)
    assert list((tmp_path / "tb" / "samples").glob("events.out.tfevents.*"))
    rows = [r for r in _metrics(tmp_path) if "reward_mean" in r]       # the RL steps' rows
    golden = json.loads((ROOT / "tests" / "golden" / "flow_default.json").read_text())
    digest = hashlib.sha256(b"".join(a.tobytes() for a in _params(tmp_path))).hexdigest()
    exact = golden["exact"].get(_this_cpu())
    if exact is not None:
        for row, want in zip(rows, exact["steps"], strict=True):
            assert {k: row.get(k) for k in want} == want
        assert digest == exact["params_sha256"]
    else:
        for row, want in zip(rows, golden["steps"], strict=True):
            same = {k: v for k, v in want.items() if not isinstance(v, float) or v == int(v) and k != "kl"}
            assert {k: row.get(k) for k in same} == same
            for k in sorted(set(want) - set(same)):
                np.testing.assert_allclose(row[k], want[k], rtol=CROSS_CPU_RTOL, atol=NOISE_ATOL, err_msg=k)
    assert [r["flow/samples"] for r in rows] == [32, 32]
    assert [r["step"] for r in rows] == [0, 1]
    # the reference is the initial policy (that the KL to it then grows: test_processes_equal_one[ppo_two_balanced]
    # at step 2, after an update with a reward signal; here step 0 has none, so nothing moves)
    assert abs(rows[0]["kl"]) < NOISE_ATOL
    for key in ("reward_mean", "response_len_mean", "response_len_max", "step_seconds", "pass_rate", "kl",
                "entropy", "clip_frac", "grad_norm", "lr", "tokens_per_s", "rollout_s", "train_s", "compiles", "compile_s"):
        assert key in rows[0]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert list((tmp_path / "tb" / "plugins" / "profile").rglob("*.xplane.pb"))
    assert (tmp_path / "hf" / "config.json").exists() and (tmp_path / "config.yaml").exists()
    assert (tmp_path / "curves.png").stat().st_size > 0
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
    assert not (tmp_path / "run" / "curves.png").exists()           # (TINY's curves=false)


def test_ppo_learns_on_the_quickstart_task(tmp_path):
    """The `ppo` graph on the quickstart recipe (its warm start, task mix and 0/1 rewards; 16 prompts a step,
    40 steps): the reward rises and the critic learns to predict the returns. Measured: mean reward 0.121
    over steps 0-9 -> 0.161 over steps 30-39; the full 250-step quickstart in the README. At XLA's default
    level, as the quickstart tests after it: they load the policy's executables it compiled (and at level 0
    its 40 steps ran slower: 281 s against 244 s in the suite). With FEWER_SHAPES, as they: the same tokens
    and rewards, and the warm-up builds 75 programs instead of 104 (134 -> 110 CPU-s alone, empty cache)."""
    run_main([f"run_dir={tmp_path}", "algo.advantage=gae", "steps=40", "algo.prompts_per_step=16", "save_every=null",
              "export_hf=false", *FEWER_SHAPES], timeout=900, env=DEFAULT_OPT)
    rows = _metrics(tmp_path)
    first, last = rows[:10], rows[-10:]
    mean = lambda rs, k: float(np.mean([r[k] for r in rs]))
    assert mean(last, "reward_mean") > mean(first, "reward_mean") + 0.03
    assert mean(last, "critic/explained_var") > 0.1 > mean(first, "critic/explained_var")
    assert sum(r["compiles"] for r in rows[1:]) == 0           # nothing compiled after the first step


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
    also reports the blocks it ran. The goldens predate background compilation (on here: step 0's rollout
    on the cover shapes), so they also pin that it changes no token and no loss beyond float32 rounding."""
    golden = json.loads((ROOT / "tests" / "golden" / "quickstart_short.json").read_text())
    run_main([f"run_dir={tmp_path}", "steps=6", "warm_start.steps=10", "save_every=null", "export_hf=false",
              *FEWER_SHAPES, *BACKWARD[backward]], timeout=900, env=DEFAULT_OPT)
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
    assert "warmup/background_wait_s" in rows[1]      # (the default background compilation: step 0 on the cover)


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
