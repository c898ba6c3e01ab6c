"""scripts/bench_cold_start.py (smoke, `--quick`: the tiny run with the warm-up on, once per mode, on the suite's
compilation cache), which is also background compilation's test against its unoptimised twin in a whole run:
`trainer.background_compile` on and off train alike (rewards, lengths, losses and gradient norms equal at
every step), the warm-up blocks on fewer executables with it, the rest compile on the thread (counted apart),
and in neither mode does a step after the first compile. The JSON's relations: the speed-up is its own
medians' ratio. Its third mode, the default at XLA's LLVM level 3 (the others at the suite's level 1, a user's),
samples the same rollouts, its losses and gradient norms within float32 rounding."""

import importlib.util
import json
import sys
from pathlib import Path

import jax
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_cold_start.py"


def test_quick_run(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_cold_start", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    out = tmp_path / "c.json"
    cache = jax.config.jax_compilation_cache_dir      # the suite's (tests/conftest.py): not timed here
    assert mod.main(["--quick", "--cache", cache, "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    runs = {r["mode"]: r for r in d["runs"]}
    assert len(d["runs"]) == 3 and set(runs) == set(mod.MODES) and d["quick"] and not d["cold"]
    bg, blocking = runs["background"], runs["blocking"]
    assert bg["metrics"] == blocking["metrics"] and d["summary"]["same_training"]       # the same training
    assert len(bg["metrics"]["loss"]) == mod.STEPS
    for r in (bg, blocking):
        assert r["compiles"][1:] == [0] * (mod.STEPS - 1)          # nothing blocks a step after the first
        assert r["step_end_s"] == sorted(r["step_end_s"]) and 0 < r["step_end_s"][-1] < r["process_s"]
    assert blocking["compiles_background"] == 0 and blocking["background_wait_s"] is None
    assert bg["compiles_background"] > 0 and bg["background_wait_s"] >= 0
    assert bg["warmup_executables"] < blocking["warmup_executables"]
    assert bg["compiles"][0] < blocking["compiles"][0]
    s = d["summary"]
    assert s["first_step_speedup"] == pytest.approx(s["modes"]["blocking"]["first_step_s"] /
                                                    s["modes"]["background"]["first_step_s"])
    assert s["modes"]["background"]["background_compiles"] == bg["compiles_background"]
    # "llvm3" runs the default at XLA's LLVM level 3, the others at the suite's level 1 (tests/conftest.py): the
    # same rollouts, the losses and gradient norms within float32 rounding (the benchmark measured 1.0e-7 relative)
    assert runs["llvm3"]["metrics"]["reward_mean"] == bg["metrics"]["reward_mean"] and s["llvm3_same_rollouts"]
    assert set(s["llvm3_max_rel_diff"]) == {"loss", "grad_norm"} and max(s["llvm3_max_rel_diff"].values()) < 1e-5
    assert s["llvm3_first_step_ratio"] == pytest.approx(s["modes"]["llvm3"]["first_step_s"] /
                                                        s["modes"]["background"]["first_step_s"])
