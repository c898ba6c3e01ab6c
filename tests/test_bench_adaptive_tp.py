"""scripts/bench_adaptive_tp.py (smoke, `--quick`: tiny model, small grid): the JSON the issue asks for
(`switch_speedup`, `switch_breakdown` for migrate, recompute and the naive restart, `predictor_mape` per
layout), the saved profile and a PNG. No timing asserts."""

import importlib.util
import json
import math
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_adaptive_tp.py"


def test_quick_run(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_adaptive_tp", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    out = tmp_path / "a.json"
    mod.main(["--quick", "--out", str(out)])
    got = json.loads(out.read_text())
    assert got["switch_speedup"] > 0 and set(got["predictor_mape"]) == {"1", "2", "4", "8"}
    assert all(0 <= v < math.inf for v in got["predictor_mape"].values())
    assert set(got["switch_breakdown"]) == {"pat_migrate_cold", "pat_migrate", "pat_recompute_cold", "pat_recompute",
                                            "naive_restart"}
    for name, parts in got["switch_breakdown"].items():
        assert set(parts) == {"weights_s", "kv_s", "compile_s", "control_s"}
        assert abs(sum(parts.values()) - got["switch"][name]["seconds"]) < 1e-6
    assert got["switch"]["pat_migrate"]["compile_s"] <= got["switch"]["pat_migrate_cold"]["compile_s"]
    best = min(got["switch"]["pat_migrate"]["seconds"], got["switch"]["pat_recompute"]["seconds"])
    assert abs(got["switch_speedup"] - got["switch"]["naive_restart"]["seconds"] / best) < 1e-9
    assert (tmp_path / "a_profile.json").exists() and out.with_suffix(".png").stat().st_size > 0
