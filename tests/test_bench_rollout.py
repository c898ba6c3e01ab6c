"""Smoke test of scripts/bench_rollout.py: `--quick` run, the JSON schema and the relations between its fields
(no timing asserts)."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_rollout.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_rollout", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_decode_flops_counts_weights_and_attention():
    """2 FLOPs per matmul weight per token plus 4·heads·head_dim per layer per context key (by hand)."""
    import models
    cfg = models.PRESETS["tiny-qwen3"]
    h, d, L = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    layer = h * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * h * cfg.intermediate_size
    per_token = 2 * (L * layer + h * cfg.vocab_size) + 4 * L * cfg.num_heads * d * (10 + 1.5)
    assert _load().decode_flops(cfg, 3, 10, 4) == 3 * 4 * per_token


def test_quick_run_writes_schema(tmp_path):
    """The JSON's rows: throughputs, ratio and GFLOP/s recomputed from their own seconds and the settings."""
    out = tmp_path / "bench.json"
    mod = _load()
    mod.main(["--out", str(out), "--quick", "--gpu-8b"])
    result = json.loads(out.read_text())
    assert (tmp_path / "bench.md").read_text().startswith("| batch |")
    assert [r["batch"] for r in result["rows"]] == [1, 4]
    st = result["settings"]
    cfg = mod.bench_config(True)          # its parameter count by hand (tied embeddings: no separate LM head)
    h, d = cfg.hidden_size, cfg.head_dim
    layer = (2 * h + h * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * h * cfg.intermediate_size
             + (2 * d if cfg.qk_norm else 0))
    weights = cfg.vocab_size * h + cfg.num_layers * layer + h
    assert result["peak"]["gflops"] > 0 and result["read_gb_s"] > 0
    assert result["machine"]["cores"] >= 1
    for r in result["rows"]:
        for key in ("ours_tok_s", "hf_tok_s", "ratio", "ours_s", "hf_s"):
            assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert isinstance(r["ours_compile_s"], float) and math.isfinite(r["ours_compile_s"])
        tokens = r["batch"] * st["new_tokens"]
        assert r["ours_tok_s"] == pytest.approx(tokens / r["ours_s"], rel=1e-12)
        assert r["hf_tok_s"] == pytest.approx(tokens / r["hf_s"], rel=1e-12)
        assert r["ratio"] == pytest.approx(r["hf_s"] / r["ours_s"], rel=1e-12)
        assert r["ratio"] == pytest.approx(r["ours_tok_s"] / r["hf_tok_s"], rel=1e-9)
        assert r["greedy_token_agreement"] == 1.0   # same weights, same greedy function
        flops = mod.decode_flops(mod.bench_config(True), r["batch"], st["prompt_len"], st["new_tokens"])
        assert r["ours_gflops"] == pytest.approx(flops / r["ours_s"] / 1e9, rel=1e-12)
        assert r["peak_fraction"] == pytest.approx(r["ours_gflops"] / result["peak"]["gflops"], rel=1e-12)
        p = r["parts"]                  # one decode step's parts, each timed alone
        assert (p["batch"], p["context"]) == (r["batch"], st["prompt_len"] + st["new_tokens"] // 2)
        assert p["layer_loop_same_tokens"] is True     # the scan-free prototypes compute the same step
        assert p["layer_loop_own_pools_same_tokens"] is True
        for key in ("step_ms", "dense_ms", "matmuls_ms", "layer_loop_ms", "layer_loop_own_pools_ms", "sampler_ms"):
            assert isinstance(p[key], float) and math.isfinite(p[key]) and p[key] > 0, (key, p)
        assert p["attention_kv_ms"] == pytest.approx(p["step_ms"] - p["dense_ms"] - p["sampler_ms"], rel=1e-12)
        assert p["weight_bytes"] == 4 * weights            # float32, every weight once
        assert p["dense_gb_s"] == pytest.approx(p["weight_bytes"] / p["dense_ms"] / 1e6, rel=1e-12)
        assert p["read_floor_ms"] == pytest.approx(p["weight_bytes"] / result["read_gb_s"] / 1e6, rel=1e-12)
    wd = result["widths"]          # the largest batch's step by page-table width, the run's buckets among them
    from jaxrl.rollout.shapes import ShapeBuckets
    max_pages = -(-(st["prompt_len"] + st["new_tokens"]) // st["page_size"])
    assert wd["batch"] == 4 and wd["buckets"] == list(ShapeBuckets.build(
        max_batch=4, max_seq_len=st["prompt_len"] + st["new_tokens"], page_size=st["page_size"]).pages)
    assert wd["buckets"][-1] == max_pages
    assert sorted(map(int, wd["step_ms"])) == sorted(set(range(2, max_pages + 1, 2)) | set(wd["buckets"]))
    assert all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in wd["step_ms"].values())
    env = result["environment"]
    assert {"jax", "torch", "cpu_cores"} <= set(env)
    assert "gpu" in result and (result["gpu"] is not None or result["gpu_reason"])
