"""scripts/bench_lpt.py (smoke, `--quick`): the JSON keys and the PNG; the engine runs the list schedule
it should (within the steps the overlap and prefill add), and LPT is never worse than FCFS."""

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_lpt.py"


def test_quick_run(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_lpt", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    out = tmp_path / "l.json"
    mod.main(["--quick", "--out", str(out)])
    got = json.loads(out.read_text())
    assert set(got["orders"]) == {"fcfs", "lpt_oracle", "lpt_predicted"}
    for o in got["orders"].values():
        assert o["list_schedule_steps"] <= o["engine_steps"] <= o["list_schedule_steps"] + 4
    assert got["orders"]["lpt_oracle"]["list_schedule_steps"] <= got["orders"]["fcfs"]["list_schedule_steps"]
    assert {"step_ratio_lpt_oracle", "speedup_lpt_oracle", "prediction_kendall_tau"} <= set(got)
    assert out.with_suffix(".png").stat().st_size > 0
