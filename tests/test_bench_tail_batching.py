"""scripts/bench_tail_batching.py (smoke, `--quick`: tiny model, one period): the JSON the issue asks for
(a top-level `speedup`, both schedules' rollout seconds per trained prompt over the same prompts), one long
round per period of four short ones, a long-tailed task (p99/median >= 10) and a PNG. No timing asserts."""

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_tail_batching.py"


def test_quick_run(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_tail_batching", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    out = tmp_path / "t.json"
    mod.main(["--quick", "--out", str(out)])
    got = json.loads(out.read_text())
    assert got["speedup"] > 0 and got["engine_step_ratio"] > 0
    assert got["length_p99_over_median"] >= 10
    tail, sync = got["tail_batching"], got["sync"]
    assert tail["trained_prompts"] == sync["trained_prompts"] == 5 * got["prompts_per_step"]   # the same prompts
    assert abs(got["speedup"] - sync["seconds_per_trained_prompt"] / tail["seconds_per_trained_prompt"]) < 1e-9
    kinds = [s["kind"] for s in got["steps"] if s["schedule"] == "tail_batching"]
    assert kinds == ["short"] * 4 + ["long"]
    assert sync["wasted_tokens"] == 0 and tail["wasted_tokens"] > 0
    assert out.with_suffix(".png").stat().st_size > 0
    # the roofline projection prices every engine step of both schedules: at least the weights' read per
    # decode step, at most that plus the FLOPs of its rows at peak, and a speed-up from those sums
    roof = got["roofline"]
    for name, n in (("sync", sync), ("tail_batching", tail)):
        assert n["traced_steps"] == n["engine_steps"] and 0 < n["decode_steps"] <= n["engine_steps"]
        for hw in ("cpu", "h100"):
            r = roof[hw]
            floor = n["decode_steps"] * r["weights_read_bytes"] / r["bandwidth"]
            assert r[f"{name}_decode_s"] >= floor * (1 - 1e-9)
    for hw in ("cpu", "h100"):
        assert abs(roof[hw]["speedup"] - roof[hw]["sync_decode_s"] / roof[hw]["tail_batching_decode_s"]) < 1e-9
