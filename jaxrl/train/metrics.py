"""Run metrics: one JSON line per step in ``run_dir/metrics.jsonl``, TensorBoard scalars, profiling.

``MetricsLogger`` is the only writer of a run's metrics and is active on the main process only (on
the others it is a no-op): per DistFlow, only scalar metrics travel to rank 0.

* ``metrics.jsonl`` — the authoritative record: one object per step,
  ``{"step": k, "time": unix_seconds, name: value, ...}``, flushed per line so ``tail -f`` and
  ``scripts/plot_run.py`` follow a live run. Non-finite floats are written as ``null`` (strict JSON,
  which jq and pandas read); strings (e.g. ``"phase": "sft"``) are kept.
* ``tb/events.out.tfevents.*`` — the numeric values as TensorBoard scalars, written with
  ``tensorboard.summary.Writer`` (TF-free; ``flax.metrics.tensorboard`` would need TensorFlow).

Resume without duplicates: ``MetricsLogger(run_dir, resume_step=k)`` drops every line with
``step >= k`` (the steps the resumed run logs again, and a half-written last line of a killed run)
through a temporary file renamed over ``metrics.jsonl``; then it rebuilds the TensorBoard events from
the kept lines into a new event file and only then deletes the older event files. Rebuilding from
the JSONL, rather than writing a ``SessionLog.START`` marker, works with every TensorBoard reader
(the Rust data server and ``EventAccumulator`` do not purge on that marker), and a kill between the
two steps leaves duplicates that the next resume removes again. ``resume_step=None`` is a fresh run
from step 0, so any earlier metrics in ``run_dir`` are dropped.

``Profiler`` traces the steps named by ``--profile-steps START:STOP`` with
``jax.profiler.start_trace``; traces land in ``run_dir/tb/plugins/profile/<timestamp>/`` and show in
TensorBoard's Profile tab once the ``xprof`` package (formerly ``tensorboard-plugin-profile``) is
installed beside TensorBoard; it is not a dependency of this project.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tensorboard.summary import Writer

from jaxrl.train.curves import read_metrics

__all__ = ["MetricsLogger", "Profiler", "parse_profile_steps", "read_rows", "run_summary"]


def _plain(value: Any) -> float | int | str | bool | None:
    """A metric value as a JSON scalar: numbers (incl. 0-d numpy/jax arrays, bfloat16) → int/float."""
    if isinstance(value, str):
        return value
    arr = np.asarray(value)
    if arr.ndim == 0 and jax.numpy.issubdtype(arr.dtype, jax.numpy.floating) and arr.dtype.kind != "f":
        arr = arr.astype(np.float32)  # bfloat16 / float8 from ml_dtypes
    if arr.ndim != 0 or arr.dtype.kind not in "biuf":
        raise TypeError(f"metric value must be a scalar number or a string, got {type(value).__name__} {arr.shape} {arr.dtype}")
    item = arr.item()
    if isinstance(item, float) and not math.isfinite(item):
        return None
    return item


def truncate_jsonl(path: Path, keep_below: int) -> list[dict]:
    """Rewrite ``path`` keeping only complete JSON lines with ``step < keep_below``; return them."""
    if not path.exists():
        return []
    kept = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] < keep_below:
                kept.append(row)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return kept


def _tb_numbers(row: dict):
    """The TensorBoard scalars of a JSONL row: numbers and bools; ``null`` (a non-finite float) → NaN."""
    for name, value in row.items():
        if name not in ("step", "time") and (value is None or isinstance(value, int | float)):
            yield name, float("nan") if value is None else float(value)


class MetricsLogger:
    """Per-step scalars → ``run_dir/metrics.jsonl`` (+ TensorBoard under ``run_dir/tb``), main process only.

    ``resume_step``: the first step this run will log; earlier records are kept, later ones dropped.
    """

    def __init__(self, run_dir: str | Path, *, is_main: bool = True, tb: bool = True, resume_step: int | None = None):
        self.run_dir = Path(run_dir)
        self.is_main = is_main
        self.path = self.run_dir / "metrics.jsonl"
        self._file = None
        self._tb = None
        if not is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        kept = truncate_jsonl(self.path, 0 if resume_step is None else int(resume_step))
        self._file = open(self.path, "a")
        if tb:
            tb_dir = self.run_dir / "tb"
            stale = sorted(tb_dir.glob("events.out.tfevents.*")) if tb_dir.exists() else []
            self._tb = Writer(str(tb_dir))
            for row in kept:  # rebuild the kept history, then drop the old files (see module docstring)
                for name, value in _tb_numbers(row):
                    self._tb.add_scalar(name, value, step=row["step"], wall_time=row.get("time"))
            self._tb.flush()
            for f in stale:
                f.unlink()

    def log(self, step: int, scalars: dict[str, Any]) -> None:
        """Append ``{"step": step, "time": now, **scalars}``; numeric values also go to TensorBoard."""
        if not self.is_main:
            return
        if self._file is None:
            raise RuntimeError(f"MetricsLogger for {self.run_dir} is closed")
        for reserved in ("step", "time"):
            if reserved in scalars:
                raise ValueError(f"metric name {reserved!r} is reserved by MetricsLogger")
        step, now = int(step), time.time()
        values = {name: _plain(value) for name, value in scalars.items()}
        self._file.write(json.dumps({"step": step, "time": round(now, 3), **values}) + "\n")
        self._file.flush()
        if self._tb is not None:
            for name, value in _tb_numbers(values):  # exactly what a rebuild from the JSONL writes
                self._tb.add_scalar(name, value, step=step, wall_time=now)
            self._tb.flush()

    def log_tb(self, tag: str, value: float, step: int) -> None:
        """A TensorBoard-only scalar (e.g. warm-start losses, which are not RL steps in metrics.jsonl)."""
        if self.is_main and self._tb is not None:
            self._tb.add_scalar(tag, float(value), step=int(step))
            self._tb.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_rows(run_dir: str | Path) -> list[dict]:
    """The complete per-step rows of ``run_dir/metrics.jsonl``, by step (the whole run, resumes included)."""
    path = Path(run_dir) / "metrics.jsonl"
    return read_metrics(path) if path.exists() else []


def run_summary(run_dir: str | Path) -> list[str]:
    """The closing lines of a run: the reward trend over the whole run (from ``metrics.jsonl``, so a
    resumed run reports from its step 0) and where its outputs are, with absolute paths."""
    run_dir = Path(run_dir).resolve()
    rows = [r for r in read_rows(run_dir) if isinstance(r.get("reward_mean"), (int, float))]
    lines = []
    if rows:
        k = max(1, len(rows) // 5)
        first = sum(r["reward_mean"] for r in rows[:k]) / k
        last = sum(r["reward_mean"] for r in rows[-k:]) / k
        lines.append(f"[train] reward mean: first {k} steps {first:.3f} -> last {k} steps {last:.3f} "
                     f"(steps {rows[0]['step']}-{rows[-1]['step']})")
    lines.append(f"[train] outputs in {run_dir}:")
    cdir = run_dir / "checkpoints"
    ckpts = sorted(int(p.name) for p in cdir.iterdir() if p.name.isdigit()) if cdir.is_dir() else []
    entries = [("metrics.jsonl", f"per-step metrics ({len(rows)} steps)"),
               ("curves.png", "reward and response-length curves"),
               ("config.yaml", "the config this run started with")]
    if ckpts:
        entries.append((f"checkpoints/{ckpts[-1]}", "newest checkpoint; the same command resumes from it"))
    entries.append(("hf", f"Hugging Face checkpoint: python -m jaxrl.generate model.hf_path={run_dir / 'hf'}"))
    for name, what in entries:
        if (run_dir / name).exists():
            lines.append(f"[train]   {name:<22} {what}")
    if (run_dir / "tb").is_dir():
        lines.append(f"[train]   TensorBoard            tensorboard --logdir {run_dir / 'tb'}")
    return lines


_STEPS_RE = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


def parse_profile_steps(steps: str | None) -> tuple[int, int] | None:
    """``"START:STOP"`` → ``(START, STOP)``: profile steps ``START <= step < STOP`` (like a slice)."""
    if steps is None or steps == "":
        return None
    m = _STEPS_RE.match(steps)
    if m is None or int(m.group(1)) >= int(m.group(2)):
        raise ValueError(f"--profile-steps expects START:STOP with integers 0 <= START < STOP (e.g. 3:5), got {steps!r}")
    return int(m.group(1)), int(m.group(2))


class Profiler:
    """Trace steps ``START <= step < STOP`` into ``run_dir/tb`` (TensorBoard's Profile tab, via xprof).

    Call ``maybe_start(step)`` before a step's work and ``maybe_stop(step, wait_for=outputs)`` after
    it; ``wait_for`` is blocked on first so the trace holds the step's device work, not only its
    dispatch. A resumed run that starts inside the window traces the rest of it. Each process traces
    its own devices; with several processes on one host their trace files share a host name, so
    profile one of them (pass ``steps=None`` elsewhere).
    """

    def __init__(self, run_dir: str | Path, steps: tuple[int, int] | str | None):
        self.logdir = Path(run_dir) / "tb"
        self.window = parse_profile_steps(steps) if isinstance(steps, str) else (tuple(steps) if steps else None)
        self.active = False
        self.done = False

    def maybe_start(self, step: int) -> bool:
        if self.window is None or self.active or self.done:
            return False
        start, stop = self.window
        if not start <= step < stop:
            return False
        self.logdir.mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(str(self.logdir))
        self.active = True
        return True

    def maybe_stop(self, step: int, *, wait_for: Any = None) -> bool:
        if not self.active or step + 1 < self.window[1]:
            return False
        self._stop(wait_for)
        return True

    def _stop(self, wait_for: Any = None) -> None:
        if wait_for is not None:
            jax.block_until_ready(wait_for)
        jax.profiler.stop_trace()
        self.active = False
        self.done = True

    def close(self) -> None:
        """Stop a trace still running (a run that ended inside the window)."""
        if self.active:
            self._stop()
