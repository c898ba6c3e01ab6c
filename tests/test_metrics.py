"""jaxrl.train.metrics (JSONL + TensorBoard, resume without duplicates, profiler) and scripts/plot_run.py."""

import importlib.util
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from jaxrl.train.metrics import MetricsLogger, Profiler, parse_profile_steps

PLOT_RUN = Path(__file__).resolve().parents[1] / "scripts" / "plot_run.py"


def read_jsonl(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_tb(run_dir, tag):
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"tensors": 0})  # 0: keep every point
    acc.Reload()
    return [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]


def test_jsonl_lines_and_tensorboard_scalars(tmp_path):
    with MetricsLogger(tmp_path) as log:
        log.log(0, {"reward_mean": jnp.float32(0.25), "response_len_max": np.int64(7), "phase": "rl"})
        log.log(1, {"reward_mean": 0.5, "loss": float("nan"), "kl": jnp.bfloat16(0.125), "ok": True})
    rows = read_jsonl(tmp_path)
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[0]["reward_mean"] == 0.25 and rows[0]["response_len_max"] == 7 and rows[0]["phase"] == "rl"
    assert rows[1]["loss"] is None  # non-finite → null keeps the file strict JSON
    assert rows[1]["kl"] == 0.125 and rows[1]["ok"] is True
    assert all(isinstance(r["time"], float) for r in rows)
    assert read_tb(tmp_path, "reward_mean") == [(0, 0.25), (1, 0.5)]
    assert np.isnan(read_tb(tmp_path, "loss")[0][1])
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1


def test_resume_drops_steps_from_resume_point(tmp_path):
    with MetricsLogger(tmp_path) as log:
        for step in range(6):
            log.log(step, {"reward_mean": float(step)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "rew')  # killed mid-line
    with MetricsLogger(tmp_path, resume_step=4) as log:
        for step in (4, 5):
            log.log(step, {"reward_mean": 100.0 + step})
    rows = read_jsonl(tmp_path)
    assert [(r["step"], r["reward_mean"]) for r in rows] == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 104), (5, 105)]
    assert read_tb(tmp_path, "reward_mean") == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 104), (5, 105)]
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1
    # a fresh run (no resume step) in the same directory starts over
    with MetricsLogger(tmp_path, tb=False) as log:
        log.log(0, {"reward_mean": -1.0})
    assert [(r["step"], r["reward_mean"]) for r in read_jsonl(tmp_path)] == [(0, -1.0)]


def test_non_main_process_writes_nothing_and_bad_input(tmp_path):
    with MetricsLogger(tmp_path / "other", is_main=False) as log:
        log.log(0, {"reward_mean": 1.0})
    assert not (tmp_path / "other").exists()
    with MetricsLogger(tmp_path, tb=False) as log:
        with pytest.raises(ValueError, match="reserved"):
            log.log(0, {"step": 1})
        with pytest.raises(TypeError, match="scalar"):
            log.log(0, {"x": np.ones(3)})
    assert not (tmp_path / "tb").exists()


@pytest.mark.parametrize("bad", ["3", "a:b", "5:3", "3:3", "-1:2", "1:2:3"])
def test_profile_steps_format_errors_name_the_flag(bad):
    with pytest.raises(ValueError, match="--profile-steps"):
        parse_profile_steps(bad)


def test_profiler_traces_the_window(tmp_path):
    assert parse_profile_steps(None) is None and parse_profile_steps(" 2 : 4 ") == (2, 4)
    idle = Profiler(tmp_path, None)
    assert not idle.maybe_start(0) and not idle.maybe_stop(0)
    prof = Profiler(tmp_path, "1:3")
    started, stopped = [], []
    x = jnp.ones((64, 64))
    for step in range(4):
        started.append(prof.maybe_start(step))
        x = jnp.tanh(x @ x)
        stopped.append(prof.maybe_stop(step, wait_for=x))
    prof.close()
    assert started == [False, True, False, False] and stopped == [False, False, True, False]
    traces = list((tmp_path / "tb" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert traces and traces[0].stat().st_size > 0


def test_plot_run_writes_png(tmp_path):
    rows = [
        {"step": 0, "phase": "sft", "response_len_mean": 5.0, "response_len_max": 9},
        {"step": 1, "phase": "rl", "reward_mean": 0.1, "response_len_mean": 6.0, "response_len_max": 11},
        {"step": 2, "phase": "rl", "reward_mean": None, "response_len_mean": 7.5, "response_len_max": 12},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3')
    spec = importlib.util.spec_from_file_location("plot_run", PLOT_RUN)
    plot_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_run)
    out = plot_run.main([str(tmp_path)])
    assert out == tmp_path / "curves.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    single = tmp_path / "one"
    single.mkdir()
    (single / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward_mean": 1.0}) + "\n")
    assert plot_run.main([str(single), "--out", str(tmp_path / "x" / "one.png")]).stat().st_size > 0
    assert plot_run.moving_average(np.array([1.0, np.nan, 3.0, 5.0]), 2).tolist() == [1.0, 1.0, 3.0, 4.0]
