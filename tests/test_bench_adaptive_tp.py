"""scripts/bench_adaptive_tp.py (smoke, `--quick`: tiny model, small grid): the JSON the issue asks for
(`switch_speedup`, `switch_breakdown` for migrate, recompute and the naive restart, `predictor_mape` per
layout), the saved profile and a PNG; the MAPE recomputed from the JSON's measured and predicted seconds,
the predictions from the saved profile, the speed-up from the switch seconds. No timing asserts."""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxrl.rollout.adaptive_tp import Predictor, Profile

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_adaptive_tp.py"


def test_quick_run(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_adaptive_tp", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    out = tmp_path / "a.json"
    mod.main(["--quick", "--out", str(out)])
    got = json.loads(out.read_text())
    layouts = {"1", "2", "4", "8"}
    assert set(got["predictor_mape"]) == set(got["predictor_mape_sum"]) == layouts
    assert set(got["trajectories"]) == set(got["predicted"]) == layouts
    prof = Profile.load(tmp_path / "a_profile.json")
    assert got["profile_points"] == {str(tp): len(lp.decode) for tp, lp in prof.layouts.items()}
    pred = Predictor(prof)
    for tp in layouts:
        rows, predicted = got["trajectories"][tp], got["predicted"][tp]
        # (batch, context tokens, seconds, longest context) of at most --max-steps (6) decode steps of one TP
        # group of at most 4·tp requests that only finish: the batch never grows, the longest bounds the mean
        assert 1 <= len(rows) == len(predicted) <= 6, tp
        assert all(len(r) == 4 and r[2] > 0 and r[0] <= r[1] <= r[0] * r[3] for r in rows), rows
        assert rows[0][0] <= 4 * int(tp) and all(a[0] >= b[0] for a, b in zip(rows, rows[1:])), rows
        # the predictions are the saved profile's, and the MAPE is theirs against the measured seconds
        assert predicted == pytest.approx([float(pred.step_latency(int(tp), b, t, lm)) for b, t, _, lm in rows],
                                          rel=1e-12)
        mape = np.mean([abs(p - r[2]) / r[2] for p, r in zip(predicted, rows)])
        assert got["predictor_mape"][tp] == pytest.approx(mape, rel=1e-9), tp
    assert got["switch_from_to"] == [2, 4]
    assert set(got["switch_breakdown"]) == {"pat_migrate_cold", "pat_migrate", "pat_recompute_cold", "pat_recompute",
                                            "naive_restart"}
    for name, parts in got["switch_breakdown"].items():
        assert set(parts) == {"weights_s", "kv_s", "compile_s", "control_s"}
        assert abs(sum(parts.values()) - got["switch"][name]["seconds"]) < 1e-6
    assert got["switch"]["pat_migrate"]["compile_s"] <= got["switch"]["pat_migrate_cold"]["compile_s"]
    best = min(got["switch"]["pat_migrate"]["seconds"], got["switch"]["pat_recompute"]["seconds"])
    assert got["switch_speedup"] == pytest.approx(got["switch"]["naive_restart"]["seconds"] / best, rel=1e-12)
    # every path starts from the same state: the same live sequences; only a migration moves KV bytes
    assert len({parts["live"] for parts in got["switch"].values()}) == 1 and got["switch"]["naive_restart"]["live"] > 0
    kv_bytes = {name: parts.get("kv_bytes") for name, parts in got["switch"].items()}
    assert kv_bytes["pat_migrate_cold"] == kv_bytes["pat_migrate"] > 0
    assert kv_bytes["pat_recompute_cold"] == kv_bytes["pat_recompute"] == 0
    assert (tmp_path / "a_profile.json").exists() and out.with_suffix(".png").stat().st_size > 0
