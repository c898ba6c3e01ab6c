"""The real model's benchmarks: scripts/bench_e2e.py's FLOP and limit accounting for `--real` on a hand-made
entry, and scripts/bench_real_profile.py's smoke test on the first two layers of SmolLM2-135M-Instruct."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from models import ModelConfig
from tests.real_model import smollm2_dir

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_e2e  # noqa: E402

# SmolLM2-135M-Instruct's shape (tests/test_smollm2.py checks the converted config.json against it).
SMOLLM2 = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, tie_embeddings=True)


def test_train_flops_is_three_forwards_plus_the_head():
    cfg = SMOLLM2
    E, d, L = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    N = L * (E * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * E * cfg.intermediate_size)
    att = 4 * L * cfg.num_heads * d
    assert bench_e2e._matmul_weights(cfg) == N
    want = 3 * 32 * (2 * N * 96 + att * 96 * 97 / 2) + 6 * E * cfg.vocab_size * 1344
    assert bench_e2e.train_flops(cfg, 32, 96, 1344) == pytest.approx(want, rel=1e-12)


def test_real_model_limits_on_a_hand_made_entry():
    cfg = SMOLLM2
    h = dict(prompts_per_step=8, group=4)
    step = dict(train_s=10.0, generate_s=4.9, engine_steps=49, completion_len_mean=40.0, completion_len_max=48)
    runs = {"jaxrl_cold": [dict(steps=[step])], "jaxrl_warm": [], "trl": [dict(steps=[dict(step, train_s=20.0)])]}
    entry = dict(max_new=48, runs=runs, jaxrl=dict(train_gflops=100.0), trl=dict(train_gflops=50.0))
    peak = dict(gflops=400.0, read_gbs=40.0)
    lim = bench_e2e.real_model_limits(entry, cfg, h, peak, dict(mean=40.0, max=40))
    assert lim["jaxrl"]["train_ideal_fraction"] == 0.25 and lim["trl"]["train_ideal_fraction"] == 0.125
    computed = bench_e2e.train_flops(cfg, 32, 96, 32 * 40.0) / 10.0 / 1e9 / 400.0     # 32 rows of pack 48 + 48
    assert lim["jaxrl"]["train_computed_fraction"] == pytest.approx(computed)
    assert lim["trl"]["train_computed_fraction"] == pytest.approx(
        bench_e2e.train_flops(cfg, 32, 88, 32 * 40.0) / 20.0 / 1e9 / 400.0)             # padded to 40 + 48
    weights = 4 * (bench_e2e._matmul_weights(cfg) + cfg.hidden_size * cfg.vocab_size)
    assert lim["weight_read_ms"] == pytest.approx(weights / 40e9 * 1e3)
    assert lim["decode_roofline_ms"] == max(lim["weight_read_ms"], lim["decode_matmul_ms"])
    assert lim["jaxrl"]["rollout_ms_per_engine_step"] == pytest.approx(100.0)
    assert lim["jaxrl"]["decode_roofline_ratio"] == pytest.approx(100.0 / lim["decode_roofline_ms"])


def test_quick_profile_on_two_layers(tmp_path):
    out = tmp_path / "profile.json"
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_real_profile.py"), "--quick", "--model",
                        str(smollm2_dir()), "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["layers"] == 2 and d["quick"] and d["provenance"]["commit"]
    assert [(r["remat"], r["micro_batches"], r["tokens_computed"]) for r in d["train"]] == [
        ("dots", 2, 2 * 21 * 96), ("layer", 1, 32 * 96)]            # the default and REAL_TRAIN's
    assert all(r["seconds"] > 0 and 0 < r["computed_fraction"] for r in d["train"])
    th = d["threads"]
    assert th["threads"] >= 1 and sum(th["seconds_by_busy_threads"].values()) > 0
    assert set(d["decode"]["steps"]) == {"engine decode_step", "layers, stacked scan", "layers, per-layer list",
                                         "LM head alone"}
    assert d["decode"]["roofline_ms"] > 0 and d["decode"]["engine_roofline_ratio"] > 0
