"""The simulator's parts: cost-model units and calibration, workloads, the virtual-time reward pool, the
rows' configs, the command line, and that every decision it makes is the mechanism module's own code."""

import ast
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxrl.sim.config import ROWS, SimConfig, mechanisms_of
from jaxrl.sim.cost import AnalyticCost, ProfileCost, kv_bytes_per_token
from jaxrl.sim.engine import Clock
from jaxrl.sim.hardware import PAT_FIG4, gpu
from jaxrl.sim.rewards import SimRewardPool
from jaxrl.sim.workload import Workload
from models import PRESETS

ROOT = Path(__file__).resolve().parents[1]
LLAMA = PRESETS["llama3.1-8b"]


# ------------------------------------------------------------------------------------------ cost models
def test_fit_reproduces_pat_fig4_latencies():
    """A test of the fit, not validation: the A40 preset's constants in use (fitted by `sim.fit.fit_pat_fig4`,
    rounded) give back the four PAT Fig. 4 latencies they were fitted to, within 1%."""
    cost = AnalyticCost(LLAMA, gpu("a40"))
    for tp, batch, context, seconds in PAT_FIG4:
        got = cost.decode_s(tp, np.full(batch, context))
        assert got == pytest.approx(seconds, rel=0.01), (tp, batch, got, seconds)
    # and the crossover the figure shows: TP8 wins alone, TP2x4 wins at a global batch of 128
    assert cost.decode_s(8, np.ones(1)) < cost.decode_s(2, np.ones(1))
    assert cost.decode_s(8, np.full(128, 1750)) > cost.decode_s(2, np.full(32, 1750))


def test_analytic_units():
    """Weights: 2 bytes x 8.03e9 parameters; KV: 128 KiB per token (Llama-3.1-8B, bf16); a single-sequence
    TP1 step on an H100 reads the weights at the fitted efficiency; a page budget in bytes."""
    cost = AnalyticCost(LLAMA, gpu("h100"))
    assert LLAMA.param_count() == pytest.approx(8.03e9, rel=0.01)
    assert kv_bytes_per_token(LLAMA, 2) == 128 * 1024
    hw = gpu("h100")
    one = cost.decode_s(1, np.ones(1))
    assert one == pytest.approx((cost.read_bytes + 128 * 1024) / (hw.hbm_bw * hw.hbm_efficiency), rel=1e-9)
    assert cost.decode_s(1, np.full(64, 4096)) > cost.decode_s(1, np.full(64, 1024)) > one    # KV reads grow
    pages = cost.pages(LLAMA, 1, page_size=16, max_batch=256, max_seq_len=8192)
    assert pages == int((80e9 * hw.kv_memory_fraction - LLAMA.param_count() * 2) // (16 * 128 * 1024))
    assert cost.pages(LLAMA, 8, page_size=16, max_batch=256, max_seq_len=8192) > 8 * pages   # TP8: more room
    # training FLOPs: 3 x 2N per token at the MFU over the devices
    t = cost.train_s(1e6, 0.0, 8)
    assert t == pytest.approx(3 * 2 * LLAMA.param_count() * 1e6 / (8 * hw.peak_flops * hw.train_mfu), rel=1e-9)


def test_analytic_pages_match_the_engine_memory_budget():
    """`AnalyticCost.pages` counts like `rollout.memory.instance_pages` on real (CPU) devices with the same
    per-device budget: the same page bytes per device and weight shard, within the replicated norms."""
    import jax

    from jaxrl.rollout.memory import instance_pages
    from models import init
    from sharding import Layout, ShardingRules, padded_vocab_for, reshard, shardings_for
    from models import logical_axes

    cfg = PRESETS["tiny-qwen3"]
    weights = init(jax.random.key(0), cfg)
    for tp in (1, 2, 4):
        layout = Layout(tp=tp)
        mesh = layout.make_mesh(jax.devices()[:tp])
        w, _ = reshard(weights, shardings_for(logical_axes(cfg, vocab_size=padded_vocab_for(cfg, layout)), mesh,
                                              ShardingRules.rollout(cfg, layout)))
        budget = 2_000_000
        real = instance_pages(cfg, mesh, w, num_pages=None, page_size=8, max_batch=8, max_seq_len=64,
                              kv_bytes_per_device=budget)
        hw = dataclasses.replace(gpu("h100"), memory_bytes=budget, kv_memory_fraction=1.0)
        sim = AnalyticCost(cfg, hw, dtype_bytes=4).pages(cfg, tp, page_size=8, max_batch=8, max_seq_len=64)
        assert sim == pytest.approx(real, rel=0.02), tp


def test_profile_cost_interpolates_the_profiled_points():
    """`ProfileCost` against its profile's points interpolated by hand, not against the `Predictor` it calls.
    Decode, paper form (TP 1, no shapes): piecewise linear in T = Σ context over each profiled batch's points,
    linear between the two nearest profiled batches, the batch clamped to the profiled range. Decode, engine
    form (TP 2, with shapes): the profiled point of the padded shape (rows bucket, page-table width of the
    longest row), whatever the other rows hold. Prefill: piecewise linear in the mean length, linear in B.
    Reshard: the profiled seconds, the slowest one when not profiled. KV move: bytes / bandwidth."""
    from jaxrl.rollout.adaptive_tp import LayoutProfile, Profile

    ms = 1e-3
    dec1 = {(1, 16): 1.0, (1, 64): 2.0, (1, 256): 6.0, (4, 16): 3.0, (4, 64): 5.0, (4, 256): 13.0}   # ms
    pre1 = {(1, 16): 0.5, (1, 64): 1.5, (4, 16): 1.0, (4, 64): 4.0}                                    # s
    dec2 = {(1, 16): 7.0, (1, 48): 8.0, (4, 16): 9.0, (4, 48): 11.0}                                   # ms
    shapes = {"batch": [1, 4], "pages": [1, 2, 4, 8], "page_size": 16}
    prof = Profile({"device": "hand"}, {
        1: LayoutProfile(1, [(b, n, s * ms) for (b, n), s in dec1.items()], [(b, n, s) for (b, n), s in pre1.items()]),
        2: LayoutProfile(2, [(b, n, s * ms) for (b, n), s in dec2.items()], [(b, n, 1.0) for b, n in dec2],
                         shapes=shapes),
    }, 2e9, {"1->2": 0.25, "2->1": 0.5}, layers=2, kv_bytes_per_token_layer=256)
    cost = ProfileCost(prof, PRESETS["tiny-qwen3"])

    def decode(tp, ctx):
        return cost.decode_s(tp, np.asarray(ctx), rows=4, width=128) / ms

    # B = 3, T = 119: on the B = 1 points (T = 16, 64, 256) 2 + 55/192 x 4 = 151/48; on the B = 4 points
    # (T = 64, 256, 1024) 3 + 55/192 x 2 = 343/96; two thirds of the way from B = 1 to B = 4: 247/72 ms
    t1 = np.interp(119, [16, 64, 256], [1.0, 2.0, 6.0])
    t4 = np.interp(119, [64, 256, 1024], [3.0, 5.0, 13.0])
    assert (t1, t4) == (pytest.approx(151 / 48), pytest.approx(343 / 96))
    assert decode(1, [40, 70, 9]) == pytest.approx(t1 + (t4 - t1) * 2 / 3) == pytest.approx(247 / 72)
    assert decode(1, [64]) == pytest.approx(2.0) and decode(1, [64] * 4) == pytest.approx(5.0)   # profiled points
    assert decode(1, [32] * 8) == pytest.approx(5.0)                 # B = 8 > 4 profiled: the B = 4 curve, T = 256
    # padded: 3 rows -> bucket 4; longest 40 -> (40 + 16) // 16 = 3 pages -> 4 (ladder) -> width 64, the width
    # of the profiled context 48 (4 pages): that point, for any shorter other rows; longest 20 -> width 32 (16's)
    assert decode(2, [40, 30, 9]) == decode(2, [40, 1, 1]) == pytest.approx(11.0)
    assert decode(2, [20]) == pytest.approx(7.0) and decode(2, [20, 3]) == pytest.approx(9.0)
    # prefill of lengths [16, 48]: B = 2, mean 32: 5/6 s on B = 1, 2 s on B = 4; a third of the way: 11/9 s
    assert cost.prefill_s(1, np.zeros(2), np.asarray([16, 48])) == pytest.approx(11 / 9)
    assert cost.reshard_s(PRESETS["tiny-qwen3"], 1, 2) == 0.25 and cost.reshard_s(PRESETS["tiny-qwen3"], 1, 8) == 0.5
    assert cost.kv_move_s(1e9) == pytest.approx(0.5)


def test_reshard_bytes_are_sharding_reuse_counts():
    """Merges between power-of-two layouts move only the replicated KV heads (the nested device order); a
    split moves weight bytes."""
    cost = AnalyticCost(PRESETS["tiny-qwen3"], gpu("h100"), dtype_bytes=4)
    cfg = PRESETS["tiny-qwen3"]                    # 2 kv heads: above tp 2 they replicate
    assert cost.reshard_bytes(cfg, 1, 2) == 0
    assert cost.reshard_bytes(cfg, 2, 8) > 0       # the replicated kv projections
    assert cost.reshard_bytes(cfg, 8, 2) > cost.reshard_bytes(cfg, 2, 8)


# ------------------------------------------------------------------------------------------ workloads
def test_parametric_workload_matches_its_targets():
    """The DeepScaleR-like preset: median ~2.9K, ~11% above 8K and ~2% above 16K (σ from the first two)."""
    wl = Workload.parametric(prompts=40000, max_new_tokens=32768, median=2931, p_above=((8192, 0.11),))
    n = np.asarray([wl.length(i, j) for i in range(3000) for j in range(4)])
    assert np.median(n) == pytest.approx(2931, rel=0.06)
    assert np.mean(n > 8192) == pytest.approx(0.11, abs=0.015)
    assert np.mean(n > 16384) == pytest.approx(0.02, abs=0.008)
    assert wl.lengths(17, 5) == wl.lengths(17, 5)                    # deterministic
    assert wl.lengths(17, 3) == wl.lengths(17, 5)[:3]                # a sample's length does not depend on n
    capped = dataclasses.replace(wl, max_new_tokens=4096)
    assert max(capped.length(i, 0) for i in range(2000)) == 4096
    rewards = [wl.reward(i, j) for i in range(400) for j in range(8)]
    assert set(rewards) == {0.0, 1.0} and 0.3 < np.mean(rewards) < 0.7


def test_trace_workload(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt_len": 12, "lengths": [5, 9], "rewards": [1, 0]}\n{"prompt_len": 3, "lengths": [40]}\n')
    wl = Workload.from_jsonl(path, max_new_tokens=32)
    assert wl.prompts == 2 and wl.prompt_tokens(0) == 12 and wl.lengths(0, 3) == [5, 9, 5]
    assert wl.lengths(1, 2) == [32, 32] and wl.reward(0, 1) == 0.0
    (tmp_path / "bad.jsonl").write_text('{"prompt_len": 12}\n')
    from jaxrl.config.base import ConfigError
    with pytest.raises(ConfigError, match="bad.jsonl:1"):
        Workload.from_jsonl(tmp_path / "bad.jsonl", max_new_tokens=32)


# ------------------------------------------------------------------------------------------ rewards
def test_reward_pool_serves_fifo_on_the_virtual_clock():
    clock = Clock()
    wl = Workload.parametric(prompts=10, max_new_tokens=64, median=10, reward_s=2.0)
    pool = SimRewardPool(clock, wl, workers=2)
    ids = [pool.submit(("sim", f"{j}:5", "3", "sim")) for j in range(3)]
    assert pool.poll() == []
    got = pool.poll(timeout=10.0)                          # waits to the first results: two workers, 2 s each
    assert clock() == 2.0 and sorted(r.id for r in got) == ids[:2]
    got = pool.poll(timeout=10.0)
    assert clock() == 4.0 and [r.id for r in got] == ids[2:] and got[0].latency_s == 4.0


def test_adaptive_code_timeouts_bound_hung_programs():
    """A code task's hung programs run to T_max with fixed timeouts; with the adaptive policy
    (`rewards.timeouts.AdaptiveTimeouts`) a prompt whose correct runs set an anchor kills them sooner."""
    from jaxrl.rewards.timeouts import AdaptiveTimeouts

    wl = Workload.parametric(prompts=50, max_new_tokens=64, median=10, code=True, hang=0.2, code_median_s=0.2,
                             code_sigma=0.3, pass_beta=(4.0, 1.0))
    busy = {}
    for adaptive in (False, True):
        pool = SimRewardPool(Clock(), wl, workers=4, timeout_s=30.0,
                             timeouts=AdaptiveTimeouts(1.5, 2.0, 30.0, enabled=adaptive))
        for rnd in range(3):                              # the same prompts again: anchors carry over
            for i in range(50):
                for j in range(4):
                    pool.submit(("sim", f"{j + 4 * rnd}:5", str(i), "sim"))
        busy[adaptive] = pool.busy_s
        assert pool.timed_out > 0
    assert busy[True] < 0.5 * busy[False]


# ------------------------------------------------------------------------------------------ configs
def test_rows_and_their_train_configs():
    from jaxrl.config.base import ConfigError
    from jaxrl.sim.config import train_config

    assert mechanisms_of("tail_batching+pat") == ("tail_batching", "pat")
    with pytest.raises(ConfigError, match="valid: pat"):
        mechanisms_of("tail+pat")
    cfg = SimConfig()
    tc = train_config(cfg, ROWS["rollpacker"], gen_gpus=8, profile=None, prompt_len=256)
    assert tc.rollout.tail_batching.enabled and tc.engine.planner.enabled and tc.trainer.stream.enabled
    assert not tc.engine.adaptive_tp.enabled and tc.placement == "colocated"
    # a combination a training run refuses is refused here with the training config's message
    with pytest.raises(ConfigError, match="trainer.stream.enabled.*simulator times the stream trainer"):
        train_config(cfg, ("disaggregated", "stream_trainer"), gen_gpus=4, profile=None, prompt_len=256)
    tc = train_config(cfg, ("skew", "pat"), gen_gpus=8, profile="p.json", prompt_len=256)    # composes now
    assert tc.rollout.skew.enabled and tc.engine.adaptive_tp.enabled
    with pytest.raises(ConfigError, match="trainer.stream.enabled.*max_staleness=1"):
        train_config(cfg, ("async_steps", "stream_trainer"), gen_gpus=4, profile=None, prompt_len=256)


def test_cli_writes_the_summary_and_figures(tmp_path):
    out = tmp_path / "sim"
    args = [sys.executable, "-m", "jaxrl.sim", "model=tiny-qwen3", "cluster.dtype=float32", "workload.median=40",
            "workload.above=128", "workload.prompt_len=16", "rollout.max_new_tokens=256",
            "engine={tp: 1, instances: 8, max_batch: 16, max_seq_len: 288, page_size: 8}",
            "algo={prompts_per_step: 8, group_size: 4}", "steps=5",
            "rows=[baseline, tail_batching, rollpacker, pat, streamrl, distflow]", "--out", str(out)]
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    rows = {row["row"]: row for row in s["rows"]}
    assert list(rows) == ["baseline", "tail_batching", "rollpacker", "pat", "streamrl", "distflow"]
    assert rows["baseline"]["speedup_vs_baseline"] == 1.0
    assert rows["tail_batching"]["rounds"] == {"short": 4, "long": 1}
    assert rows["distflow"]["driver_s"] == 0 < rows["baseline"]["driver_s"]
    assert rows["streamrl"]["gen_gpus"] + rows["streamrl"]["train_gpus"] == 8
    for row in rows:
        assert (out / f"gantt_{row}.png").stat().st_size > 0
    assert "| baseline |" in (out / "table.md").read_text() and (out / "breakdown.png").exists()
    # the step record of each row is in the summary; the steps add up to the row's seconds
    steps = s["steps_by_row"]["rollpacker"]
    assert math.isclose(sum(x["step_s"] for x in steps), rows["rollpacker"]["seconds"], rel_tol=1e-9)
    # the stream trainer freed half the GPUs in the long round (the only round without a race)
    assert [x["kind"] for x in steps] == ["short"] * 4 + ["long"] and 0 < steps[4]["shrunk_at"] <= 0.5
    assert not any(x["shrunk_at"] for x in steps[:4])


def test_async_rows_run_up_to_max_staleness_ahead(tmp_path):
    """async_steps rows with max_staleness = k: rollout m starts when the generation pool is free and the
    weights of step m − k − 1's update have reached it (the trainer's `RolloutSide.run_ahead`), never earlier;
    the disaggregated synchronous row waits for the last step's."""
    out = tmp_path / "sim"
    args = [sys.executable, "-m", "jaxrl.sim", "model=tiny-qwen3", "cluster.dtype=float32", "workload.median=40",
            "workload.above=128", "workload.prompt_len=16", "rollout.max_new_tokens=256",
            "engine={tp: 1, instances: 8, max_batch: 16, max_seq_len: 288, page_size: 8}",
            "algo={prompts_per_step: 8, group_size: 4}", "steps=5", "max_staleness=2",
            "rows=[disaggregated, 'disaggregated+async_steps']", "--out", str(out)]
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    by_row = json.loads((out / "summary.json").read_text())["steps_by_row"]
    for row, k in (("disaggregated", 0), ("disaggregated+async_steps", 2)):
        steps = by_row[row]
        gen_free = [x["start"] + x["rollout_s"] for x in steps]
        for m in range(1, len(steps)):
            ready = steps[m - k - 1]["end"] if m - k - 1 >= 0 else 0.0
            assert steps[m]["start"] == pytest.approx(max(gen_free[m - 1], ready), abs=1e-9), (row, m)
    assert by_row["disaggregated+async_steps"][-1]["end"] < by_row["disaggregated"][-1]["end"]


def test_cli_bad_key_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "jaxrl.sim", "cluster.gpu=b200", "--out", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "cluster.gpu" in r.stderr and "h100" in r.stderr


def test_sweep_resume_keeps_the_points_already_simulated(tmp_path, capsys):
    """A sweep writes its summary after every point; `--resume` reads a point made from the same config
    and simulates the others (here: one more value)."""
    from jaxrl.sim.__main__ import main

    base = ["model=tiny-qwen3", "cluster.dtype=float32", "workload.median=20", "workload.above=64",
            "workload.prompt_len=16", "rollout.max_new_tokens=64",
            "engine={tp: 1, instances: 8, max_batch: 16, max_seq_len: 96, page_size: 8}",
            "algo={prompts_per_step: 4, group_size: 4}", "steps=1", "rows=[baseline]", "sweep=cluster.gpus",
            "--out", str(tmp_path)]
    assert main([*base, "values=[8]"]) == 0
    first = json.loads((tmp_path / "cluster.gpus=8" / "summary.json").read_text())
    capsys.readouterr()
    assert main([*base, "values=[8, 16]", "--resume"]) == 0
    err = capsys.readouterr().err
    assert "cluster.gpus=8: read from" in err and "cluster.gpus=16: read from" not in err
    s = json.loads((tmp_path / "summary.json").read_text())
    assert [p["value"] for p in s["points"]] == [8, 16] and s["complete"]
    assert s["points"][0]["rows"] == first["rows"]
    assert main([*base, "values=[8]", "steps=2", "--resume"]) == 0          # another config: simulated again
    assert "read from" not in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ no copies
DECISIONS = {   # mechanism module -> the decision functions and classes the simulator must take from it
    "jaxrl/rollout/scheduler.py": ["Scheduler"],
    "jaxrl/rollout/instance.py": ["Instance"],
    "jaxrl/rollout/tail_batching.py": ["Race", "TailBatcher", "launch_counts"],
    "jaxrl/rollout/planner.py": ["TPPlanner", "apply", "candidate_tps"],
    "jaxrl/rollout/adaptive_tp.py": ["Predictor", "SwitchController", "merge_and_redistribute"],
    "jaxrl/rollout/tp_switch.py": ["AdaptiveTP"],
    "jaxrl/rollout/skew.py": ["plan_placement", "choose_split", "split_long"],
    "jaxrl/rollout/migration.py": ["attach", "deal", "attach_dealt"],
    "jaxrl/train/shrink.py": ["milestone_due", "plan_shrink", "projected_lengths", "peak_pages", "shrink_plan",
                              "take_shrink"],
    "jaxrl/train/balance.py": ["best_split", "scale_up_due"],
    "jaxrl/train/rounds.py": ["tail_round"],
    "jaxrl/train/rl.py": ["rollout_and_score", "score_batch"],
    "jaxrl/train/rollout_loop.py": ["RolloutLoop", "Requests"],
    "jaxrl/train/rollout_components.py": ["RaceSelection", "StreamedRewards", "GroupStream", "StepProgress"],
    "jaxrl/rewards/timeouts.py": ["AdaptiveTimeouts"],
    "jaxrl/rollout/profile.py": ["measure_layout", "measure_point"],
}


def _defs(path: Path) -> dict[str, str]:
    """Every function (methods included) of a file: name -> its body's AST dump (names kept, positions not)."""
    out = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out.setdefault(node.name, ast.dump(ast.Module(body=node.body, type_ignores=[]), annotate_fields=False))
    return out


def test_every_decision_is_imported_not_copied():
    """No file of jaxrl/sim defines a decision function or class of a mechanism module (by name), none holds a
    function whose body is a mechanism function's body, and the objects the simulator uses are the modules'."""
    sim_files = sorted((ROOT / "jaxrl" / "sim").glob("*.py"))
    sim_defs = {f"{p.name}:{n}": body for p in sim_files for n, body in _defs(p).items()}
    names = {n.split(":")[1] for n in sim_defs}
    for module, decisions in DECISIONS.items():
        mod_defs = _defs(ROOT / module)
        for name in decisions:
            assert name in mod_defs, f"{module} has no {name} (update this test)"
            assert name not in names, f"jaxrl/sim defines its own {name} (the one in {module} must be used)"
        bodies = {body: n for n, body in mod_defs.items() if body.count("(") > 8}      # non-trivial bodies
        copied = [(s, bodies[b]) for s, b in sim_defs.items() if b in bodies]
        assert not copied, f"jaxrl/sim copies {module}: {copied}"
    import jaxrl.rollout.tp_switch as tp_switch
    import jaxrl.sim.engine as engine
    import jaxrl.sim.run as run
    from jaxrl.rollout import instance, planner, scheduler, tail_batching
    from jaxrl.train import rl, rounds, shrink

    assert issubclass(engine.SimInstance, instance.Instance) and engine.SimInstance.launch is instance.Instance.launch
    assert engine.SimInstance.collect is instance.Instance.collect and engine.Scheduler is scheduler.Scheduler
    assert run.TailBatcher is tail_batching.TailBatcher and run.tail_round is rounds.tail_round
    assert run.TPPlanner is planner.TPPlanner and run.rl is rl and run.shrink_plan is shrink.shrink_plan
    assert run.milestone_due is shrink.milestone_due and run.take_shrink is shrink.take_shrink
    assert tp_switch.AdaptiveTP.after_step.__module__ == "jaxrl.rollout.tp_switch"


def test_simulated_split_is_best_split_over_every_simulated_rollout(tmp_path):
    """split=simulated: the disaggregated row's GPU split is `best_split` over T_g(x) = its first rollout
    simulated on x GPUs, for every x (computed here one by one), T_t scaled from the baseline's training. The
    search behind it (`searched_split`) simulated fewer rollouts than there are candidates, and the summary
    records them. A 7B model's rollout of long-tailed responses stops speeding up with more GPUs, so the split
    leaves the train pool more GPUs than scaling the generation time as work / GPUs would."""
    import importlib

    from jaxrl.config.loading import load_config
    from jaxrl.train.balance import best_split, scaled

    sim_mod = importlib.import_module("jaxrl.sim.simulate")     # (the package exports the function of that name)
    cfg = load_config(SimConfig, ["model=qwen2.5-7b", "cluster.gpus=8", "workload.reward_s=0.001",
                                  "workload.median=40", "workload.above=128", "workload.prompt_len=16",
                                  "rollout.max_new_tokens=256", "engine={tp: 1, instances: 8, max_batch: 64, "
                                  "max_seq_len: 288}", "algo={prompts_per_step: 32, group_size: 8}", "steps=2",
                                  "rows=[baseline, disaggregated]", "split=simulated"])
    base, dis = sim_mod.simulate(cfg, out=tmp_path, progress=False)["rows"]
    cost, workload = sim_mod.build_cost(cfg, PRESETS["qwen2.5-7b"]), cfg.workload.build(cfg.rollout.max_new_tokens)
    t_gen = {x: sim_mod._rollout_s(cfg, "disaggregated", cost, workload, None, x, False) for x in range(1, 8)}
    t_train = scaled(base["forward_s"] + base["train_s"], 8)
    assert (dis["gen_gpus"], dis["train_gpus"]) == best_split(8, 1, range(1, 8), t_gen.__getitem__, t_train)[:2]
    seen = {int(x): t for x, t in dis["split_rollout_s"].items()}
    assert len(seen) < 7 and all(t == t_gen[x] for x, t in seen.items())
    by_work = best_split(8, 1, range(1, 8), scaled(base["rollout_s"] + base["reward_s"], 8), t_train)[:2]
    assert dis["train_gpus"] > by_work[1] and t_gen[1] > t_gen[7]
