"""scripts/bench_train.py (smoke, `--quick`): the JSON's structure, a real jaxrl-vs-torch agreement, positive
finite times, no compilation while timing; the agreement check rejects perturbed weights and a failed
agreement times nothing (no timing asserts). The attention FLOP count is checked against two independent
counts (the causal mask's visible columns per query chunk, by brute force, and the dot FLOPs in the traced
forward and backward of `attention_chunked` itself), and the committed scripts/results/bench_train.json
against the formula and its own arithmetic (GFLOP/s = FLOPs / seconds, peak fraction = GFLOP/s / peak)."""

import dataclasses
import importlib.util
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.attention import BlockSizes, attention_chunked

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_train.py"
COMMITTED = SCRIPT.parent / "results" / "bench_train.json"


def _load():
    spec = importlib.util.spec_from_file_location("bench_train", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod            # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    mod = _load()
    out = tmp_path_factory.mktemp("bench_train") / "sub" / "train.json"
    returned = mod.main(["--quick", "--out", str(out)])
    return mod, returned, json.loads(out.read_text())


def test_quick_run_writes_json(quick):
    mod, returned, got = quick
    assert got == json.loads(json.dumps(returned))
    assert {"cpu", "cores", "jax", "torch", "transformers", "torch_threads"} <= set(got["machine"])
    assert got["machine"]["torch_threads"] == 2
    assert got["flops_formula"] == mod.FLOPS_FORMULA and got["note"] and got["settings"]["repeats"] == 1
    assert got["peak_gflops_float32"] is None or _positive(got["peak_gflops_float32"])
    for key in ("loadavg_before", "loadavg_after"):
        assert got[key] is None or (len(got[key]) == 3 and all(x >= 0 for x in got[key]))

    rows = got["rows"]
    assert [(r["shape"], r["batch"]) for r in rows] == [("tiny", "4x24")]
    for r in rows:
        for key in ("jaxrl_s", "torch_s", "ratio", "jaxrl_gflops", "torch_gflops", "jaxrl_median_s", "torch_median_s",
                    "gflop_per_step", "jaxrl_compile_s"):
            assert _positive(r[key]), (key, r[key])
        assert math.isclose(r["ratio"], r["torch_s"] / r["jaxrl_s"])
        assert r["tokens"] == 4 * 24 and r["remat"] == mod.TrainerSection().remat
        assert math.isclose(r["jaxrl_gflops"], r["flops"]["total"] / r["jaxrl_s"] / 1e9)
        assert r["flops"]["total"] == r["flops"]["dense"] + r["flops"]["lm_head"] + r["flops"]["attention"]
        assert r["flops"] == mod.step_flops(mod.QUICK_MODELS["tiny"], 4 * 24, 24)
        peak = got["peak_gflops_float32"]
        assert r["peak_fraction"] is None or math.isclose(r["peak_fraction"], r["jaxrl_gflops"] / peak)
        assert r["compiles_during_timing"] == 0
        assert len(r["jaxrl_times_s"]) == len(r["torch_times_s"]) == 1
    assert got["compiles_during_timing"] == 0


def test_quick_run_agreement_is_real(quick):
    mod, _, got = quick
    agree = got["agreement"]
    assert agree["passed"] and agree["tolerances"] == mod.TOLERANCES
    cases = agree["cases"]
    assert [(c["shape"], c["case"]) for c in cases] == [("tiny", "on_policy"), ("tiny", "off_policy")]
    for c in cases:
        assert c["passed"] and not c["failures"] and not c["skipped"]
        assert c["segments_per_row_max"] >= 2          # jaxrl packs, torch does not: same quantities compared
        assert math.isfinite(c["loss_jaxrl"]) and c["loss_jaxrl"] != 0
        assert c["loss_rel"] <= mod.TOLERANCES["loss_rel"] and c["logp_max_abs_diff"] <= mod.TOLERANCES["logp_abs"]
        assert c["metrics_jaxrl"]["tokens"] == c["metrics_torch"]["tokens"] == c["response_tokens"]
        assert _positive(c["metrics_jaxrl"]["kl"]) and _positive(c["metrics_jaxrl"]["grad_norm"])
        per = c["update"]["per_tensor"]
        assert len(per) == 13                            # tiny qwen3, tied: every HF tensor compared
        for name, t in per.items():
            assert _positive(t["max_update"]), name     # every tensor moved
            assert 0 <= t["rel"] <= mod.TOLERANCES["update_rel"] and 0 <= t["l2_rel"] <= mod.TOLERANCES["update_l2_rel"]
    off = cases[1]["metrics_jaxrl"]["clip_frac"]
    assert 0 < off < 1 and cases[0]["metrics_jaxrl"]["clip_frac"] == 0     # off-policy exercises the clip


def test_check_rejects_perturbed_weights(quick):
    mod, _, got = quick
    rng = np.random.default_rng(0)
    before = {"w": rng.standard_normal((64, 32)).astype(np.float32), "n": np.ones(32, np.float32)}
    theirs = {k: (v - 1e-3 * np.sign(rng.standard_normal(v.shape))).astype(np.float32) for k, v in before.items()}
    case = dict(got["agreement"]["cases"][0])

    same = mod.update_agreement(before, {k: v.copy() for k, v in theirs.items()}, theirs)
    assert same["max_rel"] == 0 and same["max_l2_rel"] == 0 and not mod.check(case | {"update": same})

    one = {k: v.copy() for k, v in theirs.items()}
    one["w"][3, 5] += 5e-5                            # one weight off by 5% of the update
    u = mod.update_agreement(before, one, theirs)
    assert u["worst"] == "w" and math.isclose(u["max_rel"], 0.05, rel_tol=1e-3)
    assert any("update rel" in f for f in mod.check(case | {"update": u}))

    scaled = {k: before[k] + 1.002 * (theirs[k] - before[k]) for k in before}      # every update 0.2% too large
    u = mod.update_agreement(before, scaled, theirs)
    assert u["max_rel"] < mod.TOLERANCES["update_rel"]                    # within the max, caught by the l2
    assert [f for f in mod.check(case | {"update": u}) if "l2" in f]

    frozen = mod.update_agreement(before, before, theirs)       # an update that did not happen
    assert math.isclose(frozen["max_rel"], 1.0, rel_tol=1e-3) and mod.check(case | {"update": frozen})
    assert mod.check(case | {"loss_rel": 1e-3}) and mod.check(case | {"logp_max_abs_diff": 1e-2})


def test_failed_agreement_times_nothing(tmp_path, monkeypatch):
    mod = _load()
    monkeypatch.setitem(mod.TOLERANCES, "logp_abs", 0.0)       # no two fp32 implementations meet this
    out = tmp_path / "train.json"
    with pytest.raises(SystemExit, match="disagree, not timing"):
        mod.main(["--quick", "--out", str(out)])
    got = json.loads(out.read_text())
    assert not got["agreement"]["passed"] and got["rows"] == []
    assert all("logp max abs diff" in f for c in got["agreement"]["cases"] for f in c["failures"])


# ------------------------------------------------------------------------------------------ FLOP count

def _brute_pairs(S: int, b: int) -> int:
    """Score entries a query-chunked causal attention computes on one row: each chunk of `b` query rows times
    the key columns any of its queries can see (a chunk's fully masked columns skipped); S <= b is one chunk."""
    visible = np.tril(np.ones((S, S), bool))
    return sum((min(S, t0 + b) - t0) * int(visible[t0:t0 + b].any(axis=0).sum()) for t0 in range(0, S, b))


def _dot_flops(jaxpr) -> int:
    """2 · multiply-adds of every dot_general in a jaxpr, nested jaxprs (pjit, custom_jvp, ...) included."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in contract)
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += _dot_flops(inner)
    return total


@pytest.fixture(scope="module")
def mod():
    return _load()


def test_causal_pairs_brute_force(mod):
    assert mod.ATTENTION_BLOCK_Q == BlockSizes().block_q_xla          # the chunk the step's attention runs with
    for b in (16, 32, 128):
        for S in (1, 5, b - 1, b, b + 1, 2 * b, 3 * b - 7, 82, 130, 1024):
            got = mod.causal_pairs(S, b)
            assert got == _brute_pairs(S, b), (S, b)
            assert S * (S + 1) // 2 <= got <= S * S
            if S <= b:
                assert got == S * S
            elif S % b == 0:
                assert got == S * (S + b) // 2
    assert mod.causal_pairs(1024) == 1024 * (1024 + 128) // 2 == 589824       # 0.5625 of the square
    assert mod.causal_pairs(82) == 82 * 82                                       # one chunk: the square


@pytest.mark.parametrize("S,b", [(40, 16), (48, 16), (12, 16), (1024, 128)])
def test_attention_term_equals_the_kernels_dot_flops(mod, S, b):
    """The traced forward and backward of attention_chunked (one row, one query head) do exactly
    12 · head_dim · causal_pairs(S) FLOPs of dots: the per-(row, layer, head) unit of step_flops' term."""
    D = 8
    q = k = v = jax.ShapeDtypeStruct((1, S, 1, D), jnp.float32)
    fwd = jax.make_jaxpr(lambda q, k, v: attention_chunked(q, k, v, block_q=b))(q, k, v)
    both = jax.make_jaxpr(jax.grad(lambda q, k, v: attention_chunked(q, k, v, block_q=b).sum(),
                                   argnums=(0, 1, 2)))(q, k, v)
    assert _dot_flops(fwd.jaxpr) == 4 * D * mod.causal_pairs(S, b)
    assert _dot_flops(both.jaxpr) == 12 * D * mod.causal_pairs(S, b)


def test_step_flops_attention_is_causal(mod):
    cfg = mod.MODELS["58m"]
    f = mod.step_flops(cfg, 8 * 1024, 1024)
    assert f["attention"] == 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * 8 * 589824
    assert f["attention_pairs_per_row"] == 589824 and f["attention_block_q"] == 128
    assert f["total"] == f["dense"] + f["lm_head"] + f["attention"]
    assert "P(S) = b^2*n(n+1)/2 + r*S" in mod.FLOPS_FORMULA and "b = 128" in mod.FLOPS_FORMULA


def test_committed_json_relations(mod):
    """scripts/results/bench_train.json: counted with the causal formula, and its figures follow from each other."""
    d = json.loads(COMMITTED.read_text())
    assert d["flops_formula"] == mod.FLOPS_FORMULA and d["agreement"]["passed"] and d["rows"]
    peak = d["peak_gflops_float32"]
    assert peak and peak > 0
    for r in d["rows"]:
        cfg = mod.MODELS[r["shape"]]
        recorded, want = d["settings"]["models"][r["shape"]], dataclasses.asdict(cfg)
        # a field the recorded run predates (e.g. `lora`, added later) must be at its None default here
        assert recorded == {k: v for k, v in want.items() if k in recorded or v is not None}
        assert r["flops"] == mod.step_flops(cfg, r["tokens"], r["seq_len"]), (r["shape"], r["batch"])
        assert r["tokens"] == r["rows"] * r["seq_len"] and r["compiles_during_timing"] == 0
        assert r["jaxrl_s"] == min(r["jaxrl_times_s"]) and r["torch_s"] == min(r["torch_times_s"])
        assert math.isclose(r["gflop_per_step"], r["flops"]["total"] / 1e9)
        assert math.isclose(r["jaxrl_gflops"], r["flops"]["total"] / r["jaxrl_s"] / 1e9)
        assert math.isclose(r["torch_gflops"], r["flops"]["total"] / r["torch_s"] / 1e9)
        assert math.isclose(r["peak_fraction"], r["jaxrl_gflops"] / peak)
        assert math.isclose(r["ratio"], r["torch_s"] / r["jaxrl_s"])
