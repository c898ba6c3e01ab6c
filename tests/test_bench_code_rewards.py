"""scripts/bench_code_rewards.py (smoke, `--quick`): JSON structure, both modes per step, adaptive cuts the
hang short once anchored and never a correct program; the summary recomputed from the steps' wall times."""

import importlib.util
import json
import statistics
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_code_rewards.py"


def test_quick_run_writes_json(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_code_rewards", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "sub" / "code.json"
    result = mod.main(["--quick", "--out", str(out)])
    got = json.loads(out.read_text())
    assert got == json.loads(json.dumps(result))
    assert [(r["step"], r["mode"]) for r in got["steps"]] == [(1, "fixed"), (1, "adaptive"), (2, "adaptive"),
                                                               (2, "fixed")]
    cfg = got["config"]
    for r in got["steps"]:
        assert r["groups"] == cfg["problems"] and r["correct_scored_1"] == r["correct"] > 0
        assert r["correct"] == cfg["problems"] * cfg["samples"] - cfg["hangs"] - cfg["wrong"]
        assert r["case_timeouts"] == cfg["hangs"] and r["pool_timeouts"] == r["crashes"] == 0
    by = {(r["step"], r["mode"]): r for r in got["steps"]}
    assert by[1, "fixed"]["timeout_mean_s"] == by[1, "adaptive"]["timeout_mean_s"] == cfg["t_max"]   # cold
    assert by[2, "adaptive"]["timeout_mean_s"] == cfg["t_min"] and by[2, "adaptive"]["saved_s"] > 0   # anchored
    assert by[2, "fixed"]["timeout_mean_s"] == cfg["t_max"] and by[2, "fixed"]["saved_s"] == 0
    s = got["summary"]
    assert {"fixed", "adaptive", "speedup_all", "speedup_warm"} <= set(s)
    for mode in ("fixed", "adaptive"):     # the summary is its steps' wall times, rounded as the script rounds
        walls = [r["wall_s"] for r in got["steps"] if r["mode"] == mode]
        assert s[mode] == {"mean_wall_s": round(statistics.mean(walls), 3), "cold_wall_s": walls[0],
                           "warm_mean_wall_s": round(statistics.mean(walls[1:]), 3)}
        assert s[mode]["warm_mean_wall_s"] > 0
    assert s["speedup_all"] == round(s["fixed"]["mean_wall_s"] / s["adaptive"]["mean_wall_s"], 2)
    assert s["speedup_warm"] == round(s["fixed"]["warm_mean_wall_s"] / s["adaptive"]["warm_mean_wall_s"], 2)
    assert got["anchors"] and got["machine"]["isolation"]
