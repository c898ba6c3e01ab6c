"""scripts/bench_lpt.py (smoke, `--quick`): the JSON keys and the PNG; the engine runs the list schedule
it should (within the steps the overlap and prefill add; the list schedules recomputed by hand), LPT is never
worse than FCFS, and the ratios are the JSON's own steps and median seconds."""

import heapq
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_lpt.py"


def _list_schedule(lengths, slots: int) -> int:
    """Decode steps of greedy list scheduling, by hand: each sequence in turn to the slot that frees first."""
    free = [0] * slots
    for n in lengths:
        heapq.heapreplace(free, free[0] + n)
    return max(free)


def test_quick_run(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_lpt", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    out = tmp_path / "l.json"
    mod.main(["--quick", "--out", str(out)])
    got = json.loads(out.read_text())
    orders, lengths, cap = got["orders"], got["lengths"], got["cap"]
    assert set(orders) == {"fcfs", "lpt_oracle", "lpt_predicted"} and len(lengths) == got["sequences"]
    assert orders["fcfs"]["list_schedule_steps"] == _list_schedule(lengths, cap)
    assert orders["lpt_oracle"]["list_schedule_steps"] == _list_schedule(sorted(lengths, reverse=True), cap)
    for o in orders.values():
        assert max(max(lengths), -(-sum(lengths) // cap)) <= o["list_schedule_steps"]   # no schedule beats these
        assert o["list_schedule_steps"] <= o["engine_steps"] <= o["list_schedule_steps"] + 4
        assert len(o["seconds"]) == got["repeats"] and o["seconds_median"] == np.median(o["seconds"])
    assert orders["lpt_oracle"]["list_schedule_steps"] <= orders["fcfs"]["list_schedule_steps"]
    for name in ("lpt_oracle", "lpt_predicted"):
        fcfs, lpt = orders["fcfs"], orders[name]
        assert got[f"step_ratio_{name}"] == pytest.approx(fcfs["engine_steps"] / lpt["engine_steps"], rel=1e-12)
        assert got[f"speedup_{name}"] == pytest.approx(fcfs["seconds_median"] / lpt["seconds_median"], rel=1e-12)
    assert got["p99_over_median"] == pytest.approx(np.percentile(lengths, 99) / np.median(lengths), rel=1e-12)
    assert -1 <= got["prediction_kendall_tau"] <= 1
    assert out.with_suffix(".png").stat().st_size > 0
