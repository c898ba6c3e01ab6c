"""scripts/bench_multiturn.py (smoke, `--quick`): both modes produce the same tokens, each prefills exactly what
its arithmetic says (continuation: each prompt and each observation once; re-prefill: every turn's whole
conversation), the same tokens are sampled, and the ratios are the JSON's own counts and median seconds."""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_multiturn.py"


def test_quick_run(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_multiturn", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    out = tmp_path / "m.json"
    mod.main(["--quick", "--out", str(out)])
    got = json.loads(out.read_text())
    n, p, g, o = got["trajectories"], got["prompt"], got["gen"], got["obs"]
    assert sorted(map(int, got["turns"])) == [2, 3]
    for turns, row in got["turns"].items():
        t = int(turns)
        c, f = row["continuation"], row["reprefill"]
        assert row["tokens_identical"] is True
        assert c["prefilled"] == n * (p - 1 + (t - 1) * o) == row["prefill_expected"]["continuation"]
        assert f["prefilled"] == n * sum(p + k * (g + o) - 1 for k in range(t)) == row["prefill_expected"]["reprefill"]
        assert c["generated"] == f["generated"] == n * t * g
        assert row["prefill_ratio"] == pytest.approx(f["prefilled"] / c["prefilled"], rel=1e-12)
        assert row["speedup"] == pytest.approx(f["seconds_median"] / c["seconds_median"], rel=1e-12)
        for m in (c, f):
            assert len(m["seconds"]) == got["repeats"] and m["seconds_median"] == np.median(m["seconds"])
