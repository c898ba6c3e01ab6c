"""scripts/bench_e2e.py's smoke test: the tiny workload, one GRPO step through TRL's GRPOTrainer and one through
`python -m jaxrl.train`, on the same HF directory, prompts and reward; the JSON has both sides' figures."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_run_writes_both_sides(tmp_path):
    cache = os.environ.get("JAXRL_COMPILATION_CACHE_DIR", str(tmp_path / "xla"))
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_e2e.py"), "--quick", "--out",
                        str(tmp_path / "e2e.json"), "--work", str(tmp_path / "work"), "--cache", cache],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    w = json.loads((tmp_path / "e2e.json").read_text())["workloads"]["tiny"]
    for side in ("jaxrl", "trl"):
        assert w[side]["step_s"] > 0 and w[side]["completion_len_mean"] >= 1 and w[side]["step_gflop"] > 0
    (trl,) = w["runs"]["trl"]
    assert trl["generate_calls"] == 1 and trl["steps"][0]["completions"] == 4      # 2 prompts x 2 samples, once
    (jax_run,) = w["runs"]["jaxrl_cold"]
    assert jax_run["steps"][0]["compiles"] > 0 and "model.hf_path=" in jax_run["command"]
    assert w["step_ratio"] > 0 and w["process_ratio_cold"] > 0
