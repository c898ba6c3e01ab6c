"""Current sharding rules vs the reviewed snapshots in `sharding/golden/` (regenerate: python -m sharding.golden --update)."""

import json

import pytest

from models.config import PRESETS
from sharding import ROLES
from sharding import golden


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_matches_golden(preset, role):
    path = golden.golden_path(preset, role)
    assert path.exists(), f"{path} missing; run: python -m sharding.golden --update"
    lines = golden.diff(json.loads(path.read_text()), golden.snapshot(preset, role))
    assert not lines, (f"sharding of {preset} ({role}) differs from {path.name} (- golden, + current):\n"
                       + "\n".join(lines) + "\nif intended: python -m sharding.golden --update, and review the diff")


def test_no_stale_golden_files():
    expected = {golden.golden_path(p, r).name for p in PRESETS for r in ROLES}
    stale = sorted(p.name for p in golden.GOLDEN_DIR.glob("*.json") if p.name not in expected)
    assert not stale, f"golden files for unknown presets/roles: {stale}; run: python -m sharding.golden --update"


def test_golden_records_layout_and_file_format():
    record = golden.snapshot("tiny-qwen3", "rollout")
    assert record["layout"] == {"dp": 1, "fsdp": 1, "tp": 4}
    assert record["specs"]["layers.wk"] == [None, None, None, None]  # 2 KV heads, tp=4: replicated
    assert json.loads(golden.dumps(record)) == record


def test_diff_is_readable():
    before = golden.snapshot("tiny-llama", "train")
    after = json.loads(json.dumps(before))
    after["specs"]["layers.wq"] = [None, None, "tp", None]
    del after["specs"]["lm_head"]
    assert golden.diff(before, after) == [
        '- layers.wq: [null, "fsdp", "tp", null]',
        '+ layers.wq: [null, null, "tp", null]',
        '- lm_head: ["fsdp", "tp"]',
    ]
