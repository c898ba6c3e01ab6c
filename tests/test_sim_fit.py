"""The simulator's fitted constants come out of `jaxrl/sim/fit.py` (tests of the fit, not validation), and its
held-out validation (`jaxrl/sim/heldout.py`, `scripts/results/sim_fit.json`) uses no fitted point and cannot
drift from the code."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from jaxrl.config.loading import from_yaml_file
from jaxrl.sim import fit, heldout
from jaxrl.sim.config import ClusterSection, SimConfig
from jaxrl.sim.cost import AnalyticCost, attended_pairs
from jaxrl.sim.hardware import GPU, PAT_FIG4, gpu
from models import PRESETS

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = json.loads((ROOT / "scripts/results/bench_sim_cluster.json").read_text())
IN_USE = (GPU.train_mfu, ClusterSection.driver_s_per_token)


def _script():
    spec = importlib.util.spec_from_file_location("sim_fit_script", ROOT / "scripts" / "sim_fit.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_fit_reproduces_the_pat_fig4_constants():
    """Newton's method on the four Fig. 4 latencies gives the A40 constants in use (rounded to 3 digits) and
    the context of hardware.PAT_FIG4; at the fitted values the model returns the four points exactly."""
    fits = {f.name: f for f in fit.fit_pat_fig4()}
    assert set(fits) == {"hbm_efficiency", "hop_latency_s", "allreduce_bw", "pat_fig4_context"}
    for f in fits.values():
        assert abs(f.rel_diff) <= fit.TOLERANCE, (f.name, f.value, f.in_use)
        assert f.points == fit.FIG4
    assert gpu("a40").hbm_efficiency == gpu("h100").hbm_efficiency == fits["hbm_efficiency"].in_use
    assert {c for _, _, c, _ in PAT_FIG4} == {1, fits["pat_fig4_context"].in_use}
    x = [fits[n].value for n in ("hbm_efficiency", "hop_latency_s", "allreduce_bw", "pat_fig4_context")]
    published = [fit.POINTS[n].value for n in fit.FIG4]
    np.testing.assert_allclose(fit.fig4_latencies(np.asarray(x)), published, rtol=1e-9)
    assert [s for *_, s in PAT_FIG4] == published


def test_fit_reproduces_its_step_points():
    """train_mfu and driver_s_per_token at the joint fit: the re-costed veRL step spends PAT's 38.2 s outside
    generation and the 128-GPU speedup is DistFlow's 2.26x; the constants in use are off by the stated STALE
    amounts (this fails when either the fit or a constant moves)."""
    fits = {f.name: f for f in fit.fit_step_constants(CLUSTER)}
    mfu, drv = fits["train_mfu"].value, fits["driver_s_per_token"].value
    steps = fit.pat_cap_steps(CLUSTER)
    assert len(steps) == 4 and all(s["max_response"] == 24576 for s in steps)
    outside = np.mean([fit.step_s(s, mfu, drv, IN_USE) - s["rollout_s"] for s in steps])
    assert outside == pytest.approx(172.5 - 134.3, rel=1e-9)
    assert fit.distflow_speedup(CLUSTER, mfu, drv, IN_USE) == pytest.approx(2.26, rel=1e-9)
    # with the constants in use the re-costing gives back the recorded steps and the recorded 2.39x
    for s in steps:
        assert fit.step_s(s, *IN_USE, IN_USE) == pytest.approx(s["step_s"], rel=1e-9)
    assert fit.distflow_speedup(CLUSTER, *IN_USE, IN_USE) == pytest.approx(2.39, abs=0.005)
    for name, stale in fit.STALE.items():
        assert fits[name].rel_diff == pytest.approx(stale, abs=0.002), (name, fits[name])
    with pytest.raises(ValueError, match="leave nothing for training"):
        fit.fit_train_mfu(CLUSTER, 1e-4, IN_USE)


def test_committed_runs_used_the_constants_in_use():
    """The step fit rescales recorded seconds from the constants the runs used; recompute one recorded step's
    forwards and driver from the recipe's workload with the constants in use (independently of the run)."""
    cfg = from_yaml_file(SimConfig, ROOT / "configs/sim/pat_llama8b_h100.yaml")
    wl = cfg.workload.build(cfg.rollout.max_new_tokens)
    p, g = cfg.algo.prompts_per_step, cfg.algo.group_size
    step = fit._steps(CLUSTER, "pat_llama8b_h100", "baseline", 2)[0]
    resp = np.asarray([wl.length(i, j) for i in range(p) for j in range(g)], np.float64)
    prompt = np.full(resp.shape, wl.prompt_len, np.float64)
    assert resp.sum() == step["response_tokens"]
    tokens, attended = resp.sum() + prompt.sum(), attended_pairs(prompt, resp)
    cost = AnalyticCost(PRESETS["llama3.1-8b"], gpu("h100"))
    assert step["forward_s"] == pytest.approx(2 * cost.forward_s(tokens, attended, 8), rel=1e-9)    # ref + old
    assert step["driver_s"] == pytest.approx(tokens * IN_USE[1], rel=1e-9)


def test_held_out_points_are_used_by_no_fit():
    fits = fit.fit_all(CLUSTER)
    inputs = fit.fit_inputs(fits)
    assert inputs <= set(fit.POINTS)
    held = [h.point for h in heldout.HELD_OUT]
    assert len(held) == len(set(held)) >= 4 and set(held) <= set(fit.POINTS)
    assert not inputs & set(held), inputs & set(held)
    assert len({fit.POINTS[h].paper for h in held}) >= 2


def test_verdicts():
    assert heldout.verdict(2.0, 2.08, "x") == "within 5%"
    assert heldout.verdict(2.0, 1.75, "x") == "within 15%"
    assert heldout.verdict(2.0, 2.5, "lacks X") == "within 30%, over: lacks X"
    assert heldout.verdict(2.0, 1.0, "lacks X") == "off by 2.00x (under): lacks X"
    assert heldout.verdict(1.0, 0.0, "lacks X").startswith("off entirely")


def test_committed_json_is_what_the_code_computes():
    """scripts/results/sim_fit.json (rendered into docs/simulator.md) equals `sim_fit.results` now."""
    committed = json.loads((ROOT / "scripts/results/sim_fit.json").read_text())
    assert committed["machine"]["cpu"]
    now = json.loads(json.dumps(_script().results(CLUSTER)))
    assert set(now) <= set(committed)

    def same(a, b, path="$"):
        if isinstance(a, dict):
            assert set(a) == set(b), path
            for k in a:
                same(a[k], b[k], f"{path}.{k}")
        elif isinstance(a, list):
            assert len(a) == len(b), path
            for i, (x, y) in enumerate(zip(a, b)):
                same(x, y, f"{path}[{i}]")
        elif isinstance(a, float):
            assert b == pytest.approx(a, rel=1e-9, abs=1e-15), path
        else:
            assert a == b, path

    for key in now:
        same(now[key], committed[key], key)


def test_held_out_predictions_are_the_simulators():
    """Spot checks against the committed runs' own tables: PAT's per-start means and the sweep's rows."""
    rows = {r["point"]: r for r in heldout.held_out(CLUSTER)}
    assert rows["pat_qwen14b_verl_gen"]["simulated"] == CLUSTER["pat_qwen3_14b_h100"]["pat"]["static"]["2"][0]
    r14 = {r["row"]: r for r in CLUSTER["rollpacker_qwen25_14b_h800"]["summary"]["rows"]}
    assert rows["rollpacker_t2_14b_trainer"]["simulated"] == r14["rollpacker"]["speedup_vs_baseline"]
    assert rows["distflow_retention_64_512"]["simulated"] == pytest.approx(0.876, abs=0.001)   # docs: 87.6%
    assert rows["pat_reshard_tp2_tp8"]["simulated"] == 0.0          # a TP2 -> TP8 split moves no weight bytes
    llama = PRESETS["llama3.1-8b"]
    assert AnalyticCost(llama, gpu("a40")).reshard_s(llama, 8, 2) > 0     # a merge does move bytes
