"""scripts/bench_tail_batching.py (smoke, `--quick`: tiny model, one period): the JSON the issue asks for
(a top-level `speedup`, both schedules' rollout seconds per trained prompt over the same prompts), one long
round per period of four short ones, a long-tailed task (p99/median >= 10) and a PNG; the ratios and totals
recomputed from the JSON's own fields, and each step's decoded tokens from its prompts' lengths and decode rows.
The third schedule, slime's carried partial responses, trains the same tokens, decodes fewer and in fewer engine
steps (the long round continues what the short rounds aborted). No timing asserts."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_tail_batching.py"


def test_quick_run(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_tail_batching", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    out = tmp_path / "t.json"
    mod.main(["--quick", "--out", str(out)])
    got = json.loads(out.read_text())
    assert got["length_p99_over_median"] >= 10
    assert got["length_p99_over_median"] == pytest.approx(got["length_p99"] / got["length_median"], rel=1e-12)
    tail, sync, carry = got["tail_batching"], got["sync"], got["carry"]
    P0, R0 = got["prompts_per_step"], got["group_size"]
    assert tail["trained_prompts"] == sync["trained_prompts"] == carry["trained_prompts"] == 5 * P0   # same prompts
    assert got["speedup"] == pytest.approx(sync["seconds_per_trained_prompt"] / tail["seconds_per_trained_prompt"],
                                           rel=1e-12)
    assert got["engine_step_ratio"] == pytest.approx(sync["engine_steps"] / tail["engine_steps"], rel=1e-12)
    assert got["carry_speedup"] == pytest.approx(sync["seconds_per_trained_prompt"] / carry["seconds_per_trained_prompt"],
                                                 rel=1e-12)
    for name in ("tail_batching", "carry"):
        assert [s["kind"] for s in got["steps"] if s["schedule"] == name] == ["short"] * 4 + ["long"]
    launch = {"short": (math.ceil(1.25 * P0), math.ceil(1.25 * R0)), "long": (P0, R0), "sync": (P0, R0)}
    for s in got["steps"]:
        assert (len(s["lengths"]), s["responses"]) == launch[s["kind"]] and s["trained"] == P0, s
        # every launched sequence takes its first token from its prefill and each later one from one decode row
        # (a carried response is a running sequence with tokens from its first step: each new token one decode row)
        assert s["decoded_tokens"] == s["decode_rows"] + s["fresh_sequences"], s
        assert s["fresh_sequences"] == len(s["lengths"]) * s["responses"] or s["carried_in"], s
        if not s["carried_in"]:
            assert s["engine_steps"] >= s["max_len"]                    # one token per sequence per engine step
        if s["kind"] != "short":       # no race: every response runs to its prompt's length (no stop token)
            assert s["decoded_tokens"] + s["carried_in"] == s["responses"] * sum(s["lengths"]), s
            assert s["wasted_tokens"] == 0 and s["max_len"] == max(s["lengths"]), s
        if s["schedule"] == "carry" and s["kind"] == "long":
            assert s["carried_in"] == sum(r["carried_out"] for r in got["steps"] if r["schedule"] == "carry") > 0
            assert s["engine_steps"] < s["max_len"]                      # the carried tokens are not decoded again
    for name, n in (("sync", sync), ("tail_batching", tail), ("carry", carry)):
        rows = [s for s in got["steps"] if s["schedule"] == name]
        for key, total in (("seconds", "seconds"), ("trained", "trained_prompts"), ("engine_steps", "engine_steps"),
                           ("decoded_tokens", "decoded_tokens"), ("wasted_tokens", "wasted_tokens")):
            assert n[total] == pytest.approx(sum(s[key] for s in rows), rel=1e-12), (name, key)
        assert n["seconds_per_trained_prompt"] == pytest.approx(n["seconds"] / n["trained_prompts"], rel=1e-12)
        assert n["decode_rows_per_step"] == pytest.approx(sum(s["decode_rows"] for s in rows) / n["decode_steps"],
                                                          rel=1e-12)
    assert sync["wasted_tokens"] == 0 and tail["wasted_tokens"] > carry["wasted_tokens"] >= 0
    # the same prompts and lengths: what tail batching wastes, carrying decodes once (the same total of useful tokens)
    assert carry["decoded_tokens"] - carry["wasted_tokens"] == tail["decoded_tokens"] - tail["wasted_tokens"]
    assert carry["decoded_tokens"] < tail["decoded_tokens"] and carry["engine_steps"] < tail["engine_steps"]
    assert out.with_suffix(".png").stat().st_size > 0
    # the roofline projection prices every engine step of both schedules: at least the weights' read per
    # decode step, at most that plus the FLOPs of its rows at peak, and a speed-up from those sums
    roof = got["roofline"]
    for name, n in (("sync", sync), ("tail_batching", tail), ("carry", carry)):
        assert n["traced_steps"] == n["engine_steps"] and 0 < n["decode_steps"] <= n["engine_steps"]
        for hw in ("cpu", "h100"):
            r = roof[hw]
            floor = n["decode_steps"] * r["weights_read_bytes"] / r["bandwidth"]
            assert r[f"{name}_decode_s"] >= floor * (1 - 1e-9)
    for hw in ("cpu", "h100"):
        assert abs(roof[hw]["speedup"] - roof[hw]["sync_decode_s"] / roof[hw]["tail_batching_decode_s"]) < 1e-9
        assert abs(roof[hw]["carry_speedup"] - roof[hw]["sync_decode_s"] / roof[hw]["carry_decode_s"]) < 1e-9
