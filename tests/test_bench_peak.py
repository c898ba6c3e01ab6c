"""scripts/bench_peak.py (smoke, `--quick`): the peak JSON's structure, positive finite figures, load_peak()."""

import importlib.util
import json
import math
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_peak.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("bench_peak", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_quick_run_writes_peak_json(tmp_path):
    mod = _load_script()
    out = tmp_path / "sub" / "peak.json"
    returned = mod.main(["--quick", "--out", str(out)])
    got = json.loads(out.read_text())
    assert got == json.loads(json.dumps(returned)) == mod.load_peak(out)
    assert mod.load_peak(tmp_path / "missing.json") is None

    m = got["machine"]
    assert {"cpu", "cores", "jax", "backend", "devices"} <= set(m)
    assert m["cores"] >= 1 and m["backend"] == "cpu" and m["devices"] and m["device_used"] == m["devices"][0]

    rows = got["gemm"]
    assert {r["name"] for r in rows} >= {"square 256"}
    for r in rows:
        assert {"name", "m", "k", "n", "dtype", "variant"} <= set(r)
        if "error" in r:            # a variant the backend refuses is recorded, never fatal
            assert r["dtype"] == "bfloat16" and isinstance(r["error"], str)
            continue
        assert _positive(r["seconds"]) and _positive(r["gflops"])
        assert math.isclose(r["gflops"], 2 * r["m"] * r["k"] * r["n"] / r["seconds"] / 1e9)
    f32 = [r for r in rows if r["dtype"] == "float32"]
    assert len(f32) == len({r["name"] for r in rows}) and all("gflops" in r for r in f32)
    assert {r["variant"] for r in rows if r["dtype"] == "bfloat16"} == set(mod.BF16_VARIANTS)

    peak = got["peak_gflops"]
    assert peak["float32"] == max(r["gflops"] for r in f32)
    assert _positive(peak["bfloat16"])          # the upcast variant always runs
    for key in ("bandwidth_gbs", "bandwidth_read_gbs", "bandwidth_fresh_output_gbs", "call_overhead_us"):
        assert _positive(got[key]), key
    assert got["timing"]["quick"] is True and isinstance(got["note"], str)
