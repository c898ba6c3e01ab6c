"""scripts/bench_ranker.py (smoke, `--quick`): the JSON keys (final recall/tau, per-refresh history,
per-task figures, baselines, config) and the PNG. No accuracy asserts beyond sanity."""

import importlib.util
import json
import math
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_ranker.py"


def test_quick_run(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_ranker", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    out = tmp_path / "r.json"
    mod.main(["--quick", "--out", str(out)])
    got = json.loads(out.read_text())
    keys = {"recall_top20", "kendall_tau", "source", "per_task", "history", "baselines", "config", "seconds"}
    assert keys <= set(got)
    assert 0 <= got["recall_top20"] <= 1 and -1 <= got["kendall_tau"] <= 1
    assert got["source"].startswith("builtin")
    assert set(got["per_task"]) == {"add", "copy", "repeat", "reverse", "sort"}
    assert all(not math.isnan(t["kendall_tau"]) for t in got["per_task"].values())
    assert [h["refresh"] for h in got["history"]] == [1, 2] and got["history"][-1]["observed"] == 600
    assert got["history"][-1]["recall_top20"] == got["recall_top20"]
    assert got["config"]["quick"] is True and got["data"]["eval_prompts"] == 200
    assert out.with_suffix(".png").stat().st_size > 0


def test_pairs_file_source(tmp_path):
    mod = sys.modules.get("bench_ranker")
    if mod is None:
        spec = importlib.util.spec_from_file_location("bench_ranker", SCRIPT)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    prompts, lengths, tasks = mod.builtin_pairs(150, seed=5)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"tokens": p, "length": n, "task": t}) + "\n"
                             for p, n, t in zip(prompts, lengths, tasks)))
    out = tmp_path / "p.json"
    mod.main(["--quick", "--pairs", str(pairs), "--refreshes", "1", "--train-steps", "5", "--out", str(out)])
    got = json.loads(out.read_text())
    assert got["source"].startswith("pairs file") and got["data"]["train_pairs"] + got["data"]["eval_prompts"] == 150
    assert set(got["per_task"]) == {"add", "copy", "repeat", "reverse", "sort"}
