"""`RUN_DIR/summary.json` (jaxrl.train.summary) from a hand-made metrics.jsonl: figures counted by hand."""

import json

import pytest

from jaxrl.train.summary import machine, summarize, write_summary


def _rows():
    rows = [{"step": 0, "time": 0.0, "phase": "sft", "loss": 2.0}]          # a warm-start row: not an RL step
    for i in range(10):                                                       # RL steps 0..9
        rows.append({"step": i, "time": float(i), "reward_mean": i / 10, "pass_rate": 0.5 if i >= 8 else 0.0,
                     "step_seconds": 1.0 + i, "rollout_s": 0.25, "reward_s": 0.0, "train_s": 0.5,
                     "response_len_mean": 4.0 if i % 2 else 6.0, "response_len_max": 10 + i,
                     "compiles": 3 if i == 0 else (1 if i == 7 else 0)})
    return rows


def test_summarize_counts_by_hand():
    s = summarize(_rows(), wall_s=12.5)
    assert s["steps"] == 10 and (s["first_step"], s["last_step"]) == (0, 9)
    assert s["window_steps"] == 2                                       # 20% of 10 steps
    assert s["wall_s"] == 12.5
    assert s["step_seconds_median"] == pytest.approx(5.5)               # median of 1..10
    assert s["rollout_s_median"] == 0.25 and s["train_s_median"] == 0.5
    assert s["reward_mean_first"] == pytest.approx(0.05)                # steps 0, 1
    assert s["reward_mean_last"] == pytest.approx(0.85)                 # steps 8, 9
    assert (s["pass_rate_first"], s["pass_rate_last"]) == (0.0, 0.5)
    assert s["response_len_mean"] == pytest.approx(5.0) and s["response_len_max"] == 19
    assert s["compiles_after_step0"] == 1


def test_summarize_edge_cases():
    s = summarize([{"step": 3, "reward_mean": 0.5, "step_seconds": None}])
    assert s["steps"] == 1 and s["window_steps"] == 1
    assert s["reward_mean_first"] == s["reward_mean_last"] == 0.5
    assert s["step_seconds_median"] is None and s["pass_rate_first"] is None
    empty = summarize([])
    assert empty["steps"] == 0 and empty["reward_mean_first"] is None


def test_write_summary_from_metrics_jsonl(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for r in _rows():
            f.write(json.dumps(r) + "\n")
        f.write('{"step": 10, "reward_me')                                  # a half-written line of a killed run
    path = write_summary(tmp_path, 3.0, resumed=True, argv=["steps=10", "--run-dir", "x"])
    s = json.loads(path.read_text())
    assert path == tmp_path / "summary.json" and not list(tmp_path.glob("*.tmp"))
    assert s["command"] == "python -m jaxrl.train steps=10 --run-dir x"
    assert s["steps"] == 10 and s["resumed"] is True and s["wall_s"] == 3.0
    assert s["reward_mean_last"] == pytest.approx(0.85)
    m = s["machine"]
    assert m == machine() and m["cores"] >= 1 and m["cpu"] and m["platform"]
