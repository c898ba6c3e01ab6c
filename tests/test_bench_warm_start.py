"""scripts/bench_warm_start.py (smoke, `--quick --cache`: on the suite's compilation cache, the tiny run once to
fill the executable store, then once with it and once without): both train alike (every step's rewards, lengths,
losses and gradient norms), the run with the store loads the rollout's steps without tracing one, the one
without traces each before loading it from JAX's cache, and the JSON's ratios are its own medians'."""

import importlib.util
import json
import sys
from pathlib import Path

import jax
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_warm_start.py"


def test_quick_run(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_warm_start", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    out = tmp_path / "w.json"
    cache = jax.config.jax_compilation_cache_dir      # the suite's (tests/conftest.py)
    assert mod.main(["--quick", "--cache", cache, "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    runs = {r["mode"]: r for r in d["runs"]}
    assert len(d["runs"]) == 2 and set(runs) == set(mod.MODES)
    store, none = runs["store"], runs["no_store"]
    assert store["metrics"] == none["metrics"] and d["summary"]["same_training"]
    assert store["compiles"][1:] == none["compiles"][1:] == [0] * (mod.STEPS - 1)
    # after the priming run every rollout step is in the store: loaded, none traced; without the store each is
    # traced and lowered, then loaded from JAX's cache (a load: compile_log's `hit`)
    p, q = store["programs"], none["programs"]
    assert p["rollout_counts"]["trace"] == p["rollout_counts"]["lower"] == p["rollout_counts"]["compile"] == 0
    assert p["rollout_counts"]["load"] == q["rollout_counts"]["load"] >= q["rollout_counts"]["trace"] > 0
    assert q["rollout_counts"]["compile"] == 0
    s = d["summary"]
    assert s["first_step_ratio"] == pytest.approx(s["modes"]["store"]["first_step_s"] /
                                                  s["modes"]["no_store"]["first_step_s"])
    assert s["modes"]["store"]["rollout_traces"] == p["rollout_counts"]["trace"]
