"""scripts/bench_blockwise.py (smoke, `--quick`: tiny model and lengths): the JSON the issue asks for
(rows of seq_len, block, full/blockwise bytes, ratio, times; times null in memory rows and memory null in
time rows), the memory accounting (C and ∇C counted in the blockwise peak, smaller blocks never need more
memory) and a PNG beside the JSON. No timing asserts."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_blockwise.py"
KEYS = {"seq_len", "block", "full_bytes", "blockwise_bytes", "ratio", "full_s", "blockwise_s"}


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("bench_blockwise", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    out = tmp_path_factory.mktemp("bench_blockwise") / "b.json"
    returned = mod.main(["--quick", "--out", str(out)])
    return returned, json.loads(out.read_text()), out


def test_rows_have_the_issue_fields(quick):
    returned, got, out = quick
    assert got["rows"] == json.loads(json.dumps(returned["rows"]))
    mem = [r for r in got["rows"] if r["full_bytes"] is not None]
    tim = [r for r in got["rows"] if r["full_s"] is not None]
    assert len(mem) == 4 and len(tim) == 2                      # lengths {64, 128} x T {16, 32}; T {16, 32}
    for r in got["rows"]:
        assert KEYS <= set(r)
    for r in mem:
        assert r["full_s"] is None and r["blockwise_s"] is None
        assert r["ratio"] == pytest.approx(r["full_bytes"] / r["blockwise_bytes"])
        # the block step's arguments hold C (cache dtype) and ∇C (float32): both counted in the peak
        assert r["block_step_parts"]["argument"] >= r["kv_cache_bytes"] + r["history_grad_bytes"]
        assert r["blockwise_bytes"] >= r["block_step_parts"]["peak"]
    for r in tim:
        assert r["full_bytes"] is None and math.isfinite(r["blockwise_s"]) and r["blockwise_s"] > 0
        assert r["blocks_run"] == -(-r["seq_len"] // r["block"])
    assert out.with_suffix(".png").stat().st_size > 1000


def test_smaller_blocks_never_need_more_memory(quick):
    _, got, _ = quick
    for L in {r["seq_len"] for r in got["rows"] if r["full_bytes"] is not None}:
        rows = sorted((r for r in got["rows"] if r["seq_len"] == L and r["full_bytes"] is not None),
                      key=lambda r: r["block"])
        assert all(a["block_step_parts"]["temp"] <= b["block_step_parts"]["temp"] for a, b in zip(rows, rows[1:]))
