"""scripts/gpu_check.py: `--smoke` (every section at tiny sizes on the CPU, Pallas in interpret mode) in a
subprocess, its JSON's structure and the relations its figures must satisfy; the one-process-per-group path
that a GPU run takes; and the bookkeeping (failures, budgets, exit status) on records made by hand."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402
from gpu_check_common import Section  # noqa: E402
from gpu_check_report import markdown, summary  # noqa: E402


def _run(args, timeout=900) -> subprocess.CompletedProcess:
    # At XLA:CPU's level 0 (jax_disable_most_optimizations), as the suite's own programs (tests/conftest.py): the
    # smoke builds ~150 programs at tiny sizes and runs each a few times, so it is compile-bound. Measured, empty
    # cache, interleaved: 36-40 CPU-s against 57-78 at a user's level 1; every section passes at both.
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    res = _run(["--out", out, "--smoke"])
    assert (out / "gpu_check.json").is_file(), res.stdout + res.stderr
    return res, json.loads((out / "gpu_check.json").read_text()), out


def _close(a, b) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def test_smoke_runs_every_section(smoke):
    res, got, _ = smoke
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert got["mode"] == "smoke" and got["exit_status"] == 0
    assert list(got["sections"]) == list(gpu_check.SECTIONS)
    for name, sec in got["sections"].items():
        assert sec["status"] == "ok", (name, sec.get("error"), sec["cases"])
        assert sec["budget_s"] == gpu_check.SECTIONS[name][3] and 0 < sec["seconds"]
        assert all(c["status"] in ("ok", "skipped") for c in sec["cases"].values()), (name, sec["cases"])
    assert not got["summary"]["failures"] and not got["summary"]["failed_checks"]
    assert got["sections"]["env"]["info"]["device"]["backend"] == "cpu"


def test_kernel_errors_below_the_cpu_tests_tolerances(smoke):
    from tests.test_attention_kernel import ATOL
    from tests.test_logprobs import TOL as LOGPROB_TOL
    from tests.test_paged_attention import TOL as PAGED_TOL

    cases = smoke[1]["sections"]["kernels"]["cases"]
    assert {c["kernel"] for c in cases.values()} == {"flash_attention", "paged_decode_attention", "token_logprobs",
                                                     "attention_pairs"}
    judged = 0
    for name, c in cases.items():
        assert c["status"] == "ok", (name, c.get("error"))
        for check, v in c["checks"].items():
            if v["tolerance"] is None:           # bf16 flash gradients: no CPU bound exists, recorded only
                assert (c["kernel"], c["dtype"], check, v["passed"]) == ("flash_attention", "bfloat16", "grad", None)
                continue
            judged += 1
            assert v["passed"] is True, (name, check, v)
            if not v.get("rtol"):                # atol only: the error itself is below the bound
                assert v["max_err"] <= v["tolerance"], (name, check, v)
    assert judged >= 12
    f32, bf16 = cases["flash/default_blocks/float32"]["checks"], cases["flash/default_blocks/bfloat16"]["checks"]
    assert f32["forward"]["tolerance"] == ATOL[jnp.float32]["fwd"]
    assert f32["grad"]["tolerance"] == ATOL[jnp.float32]["grad"]
    assert bf16["forward"]["tolerance"] == ATOL[jnp.bfloat16]["fwd"]
    assert f32["forward"]["max_err"] <= ATOL[jnp.float32]["fwd"] and f32["grad"]["max_err"] <= ATOL[jnp.float32]["grad"]
    paged = cases["paged/gqa2/float32"]["checks"]["output"]
    assert (paged["tolerance"], paged["rtol"]) == (PAGED_TOL[jnp.float32]["atol"], PAGED_TOL[jnp.float32]["rtol"])
    logp = cases["logprob/37x100/bfloat16"]["checks"]["logp"]
    assert logp["rtol"] == LOGPROB_TOL[jnp.bfloat16]["rtol"] and logp["tolerance"] >= LOGPROB_TOL[jnp.bfloat16]["atol"]


def test_fractions_are_achieved_over_the_measured_peak(smoke):
    secs = smoke[1]["sections"]
    env = secs["env"]
    rows = env["cases"]["matmul_peak"]["rows"]
    for dt in ("bfloat16", "float32"):
        assert env["info"]["peak_gflops"][dt] == max(r["gflops"] for r in rows if r["dtype"] == dt and "gflops" in r)
    copy = env["info"]["copy_gbs"]
    assert copy == env["cases"]["copy_bandwidth"]["copy_gbs"] > 0

    eng = secs["engine"]["cases"]
    assert eng["pallas_equals_xla"]["checks"]["tokens_identical"]["passed"] is True
    assert eng["pallas_equals_xla"]["token_agreement"] == 1.0
    decode = [c for k, c in eng.items() if k.startswith("decode/")]
    assert decode
    for r in decode:
        assert r["status"] == "ok" and r["copy_gbs"] == copy
        assert _close(r["decode_tok_s"], r["batch"] / r["decode_step_s"])
        assert _close(r["achieved_gbs"], r["step_bytes"] / r["decode_step_s"] / 1e9)
        assert _close(r["hbm_fraction"], r["achieved_gbs"] / copy)
        assert r["generated"] == r["batch"] * r["new_tokens"]
    assert all(c["status"] == "skipped" and "CPU" in c["reason"] for k, c in eng.items() if k.startswith("hf/"))

    step = secs["train"]["cases"]["jax_step"]
    f = step["flops"]
    S, rows = step["seq_len"], step["rows"]       # causal as computed vs the full S x S square
    assert f["total_causal"] == f["total"] and f["attention"] > 0
    assert f["total_full_square"] - f["total"] == f["attention"] // f["attention_pairs_per_row"] * (S * S) - f["attention"]
    assert f["attention_pairs_per_row"] <= S * S and f["attention"] % (rows * f["attention_pairs_per_row"]) == 0
    assert step["peak_gflops"] == env["info"]["peak_gflops"][step["dtype"]]
    assert _close(step["achieved_gflops"], f["total_causal"] / step["step_s"] / 1e9)
    assert _close(step["mfu"], step["achieved_gflops"] / step["peak_gflops"])
    assert _close(step["mfu_full_square"], f["total_full_square"] / step["step_s"] / 1e9 / step["peak_gflops"])

    mem = [c for k, c in secs["memory"]["cases"].items() if k.startswith("compiled/")]
    assert mem
    for r in mem:
        assert r["full_bytes"] > 0 and r["blockwise_bytes"] > 0
        assert _close(r["ratio"], r["full_bytes"] / r["blockwise_bytes"])
    assert "compiled figures only" in secs["memory"]["info"]["measured"]      # the CPU has no memory_stats


def test_profile_is_written_and_the_simulator_loads_it(smoke):
    from jaxrl.rollout.adaptive_tp import Profile
    from jaxrl.sim.config import ClusterSection, SimConfig
    from jaxrl.sim.simulate import build_cost
    from models import PRESETS

    _, got, out = smoke
    prof_case = got["sections"]["profile"]["cases"]["measure"]
    path = out / prof_case["path"]
    assert path.is_file() and path.with_suffix(".png").is_file()
    prof = Profile.load(path)
    assert list(prof.layouts) == [1] and len(prof.layouts[1].decode) == prof_case["points"] > 0
    assert prof.layouts[1].shapes is not None                      # grid=shapes: the padded shapes are recorded
    cost = build_cost(SimConfig(model="tiny-qwen3", cluster=ClusterSection(profile=str(path), dtype="float32")),
                      PRESETS["tiny-qwen3"])
    b, ctx, sec = prof.layouts[1].decode[0]
    assert math.isfinite(float(cost.predictor.step_latency(1, b, ctx))) and sec > 0
    assert got["sections"]["profile"]["cases"]["sim_loads"]["status"] == "ok"


def test_targets_are_recorded_and_not_applied_on_the_cpu(smoke):
    got = smoke[1]
    rows = {t["name"]: t for t in got["summary"]["targets"]}
    assert set(rows) == {"predictor_mape", "tail_batching"}
    for t in rows.values():
        assert t["status"] == "ok" and t["applies"] is False and math.isfinite(t["value"]) and t["value"] >= 0
    mape, tail = rows["predictor_mape"], rows["tail_batching"]
    assert mape["target"] == 0.04 and mape["met"] == (mape["value"] <= 0.04)
    assert tail["target"] == 2.0 and tail["met"] == (tail["value"] >= 2.0)
    tb = got["sections"]["targets"]["cases"]["tail_batching"]
    assert _close(tb["value"], tb["sync"]["seconds_per_trained_prompt"]
                  / tb["tail_batching"]["seconds_per_trained_prompt"])
    assert tb["sync"]["trained_prompts"] == tb["tail_batching"]["trained_prompts"] > 0


def test_markdown_is_rendered_from_the_json(smoke):
    _, got, out = smoke
    md = (out / "gpu_check.md").read_text()
    assert md == markdown(got)
    for heading in ("Versions and device", "Kernels vs references", "Engine", "Train step", "Memory",
                    "Latency profile", "Targets"):
        assert f"#### {heading}" in md
    for name in got["sections"]["kernels"]["cases"]:
        assert f"| {name} |" in md
    res = _run(["--render", out / "gpu_check.json"], timeout=60)
    assert res.returncode == 0 and res.stdout == md


def test_isolated_groups_and_the_whole_run_budget(tmp_path):
    """The GPU path: each group in a child process (env here), its record read back; a run whose budget is spent
    starts nothing more and says so."""
    res = _run(["--out", tmp_path / "a", "--smoke", "--isolate", "--sections", "env"], timeout=300)
    got = json.loads((tmp_path / "a" / "gpu_check.json").read_text())
    assert res.returncode == 0, res.stdout + res.stderr
    assert got["isolate"] is True and list(got["sections"]) == ["env"] and got["sections"]["env"]["status"] == "ok"
    assert "===== env" in (tmp_path / "a" / "gpu_check.log").read_text()
    res = _run(["--out", tmp_path / "b", "--smoke", "--isolate", "--sections", "env,kernels", "--total-s", "5"],
               timeout=60)
    got = json.loads((tmp_path / "b" / "gpu_check.json").read_text())
    assert res.returncode == 1
    for sec in got["sections"].values():
        assert sec["status"] == "skipped" and "whole-run budget of 5 s spent" in sec["error"]
    assert got["summary"]["sections_not_ok"] == {"env": "skipped", "kernels": "skipped"}


def test_a_failing_case_is_recorded_and_the_budget_skips_the_rest(tmp_path):
    s = Section("demo", 60, smoke=True, shared={}, parts=tmp_path)
    assert s.case("fine", lambda: {"x": 1}) == {"x": 1}
    assert s.case("broken", lambda: 1 / 0) is None
    assert s.cases["fine"]["status"] == "ok" and s.cases["fine"]["x"] == 1
    assert s.cases["broken"]["status"] == "failed" and "ZeroDivisionError" in s.cases["broken"]["error"]
    assert s.status() == "failed"
    late = Section("late", 0, smoke=True, shared={}, parts=tmp_path)
    assert late.case("never", lambda: {"ran": True}) is None
    assert late.cases["never"] == {"status": "skipped", "reason": "section budget of 0 s spent"}
    assert late.status() == "partial" and json.loads((tmp_path / "late.json").read_text())["status"] == "running"
    result = {"sections": {"demo": s.record(), "late": late.record()}}
    result["summary"] = summary(result)
    assert result["summary"]["sections_not_ok"] == {"demo": "failed"}
    assert any(f.startswith("demo/broken: ZeroDivisionError") for f in result["summary"]["failures"])
    assert gpu_check.exit_status(result) == 1
    result["sections"]["demo"]["cases"]["broken"] = {"status": "ok", "checks": {
        "forward": {"max_err": 0.5, "tolerance": 0.1, "passed": False}}}
    result["sections"]["demo"]["status"] = "ok"
    result["summary"] = summary(result)
    assert result["summary"]["failed_checks"] == ["demo/broken/forward: 0.5 > 0.1"]
    assert gpu_check.exit_status(result) == 1


def test_programs_section_lists_what_ci_exports(smoke):
    """The report lists every program tests/test_cuda_export.py lowers (one list: jaxrl.train.gpu_programs), in
    the JSON and the Markdown; on the CPU the smoke lowers two of them for CUDA as CI does."""
    from jaxrl.train import gpu_programs

    _, got, out = smoke
    sec = got["sections"]["programs"]
    names = [p.name for p in gpu_programs.programs()]
    assert sec["info"]["programs"] == names and sec["info"]["count"] == len(names)
    assert set(sec["cases"]) <= set(names) and len(sec["cases"]) == 2
    for name, c in sec["cases"].items():
        assert c["status"] == "ok" and c["mode"] == "cuda export" and c["triton_calls"] >= 1, (name, c)
    md = (out / "gpu_check.md").read_text()
    assert f"{len(names)} programs (`jaxrl.train.gpu_programs`" in md
    assert all(f"| {n} |" in md for n in names)
