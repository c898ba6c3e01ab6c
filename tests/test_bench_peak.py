"""scripts/bench_peak.py (smoke): writes the peak JSON with positive, finite figures."""

import importlib.util
import json
import math
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_peak.py"


def test_quick_run_writes_peak_json(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_peak", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "peak.json"
    mod.main(["--quick", "--out", str(out)])
    got = json.loads(out.read_text())
    assert got == mod.load_peak(out)
    assert math.isfinite(got["peak_gflops"]["float32"]) and got["peak_gflops"]["float32"] > 0
    assert math.isfinite(got["bandwidth_gbs"]) and got["bandwidth_gbs"] > 0
    f32 = [r for r in got["gemm"] if r["dtype"] == "float32"]
    assert f32 and all(r["gflops"] == 2 * r["m"] * r["k"] * r["n"] / r["seconds"] / 1e9 for r in f32)
    assert {r["variant"] for r in got["gemm"] if r["dtype"] == "bfloat16"} == {"native", "upcast"}
    assert got["machine"]["cores"] >= 1
