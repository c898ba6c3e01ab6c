"""scripts/bench_lora.py at tiny sizes: every part writes its rows, and their relations hold (LoRA trains and
syncs fewer bytes; the low-rank and merged decodes agree; the reference costs nothing with LoRA)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_run_writes_every_part(tmp_path):
    out = tmp_path / "l.json"
    # At XLA:CPU's level 0, as the suite's own programs (tests/conftest.py): compile-bound at these sizes. Measured,
    # empty cache: 37 CPU-s against 82 at a user's level 1, with the same figures for every relation checked here.
    env = dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_lora.py"), "--quick", "--repeats", "1",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(out.read_text())
    full, lora = d["sync"]
    assert 0 < lora["bytes_moved"] < full["bytes_moved"] and lora["trainable_bytes"] < full["trainable_bytes"]
    assert all(r["sequences_identical"] == r["sequences"] for r in d["decode"])
    mem = {r["kind"]: r for r in d["memory"]}
    assert mem["lora"]["reference_bytes"] == 0 and mem["full"]["reference_bytes"] == mem["full"]["weight_bytes"]
    assert d["train"][0]["lora_mem"]["argument"] < d["train"][0]["full_mem"]["argument"]
    assert all(r["ratio"] > 1 for r in d["blockwise"])
