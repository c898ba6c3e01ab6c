"""Training curves of one run as a PNG, from its ``metrics.jsonl``.

The trainer draws ``RUN_DIR/curves.png`` itself at the end of every run (`plot_run(run_dir)`); the
same from a shell, e.g. for a run still in progress:

    python scripts/plot_run.py RUN_DIR                  # writes RUN_DIR/curves.png
    python scripts/plot_run.py RUN_DIR --out plot.png

Two panels over the step: ``reward_mean`` (raw, thin) with its trailing moving average (and, for a
multi-turn run, ``env/tool_calls_mean``'s and ``env/tool_success``'s), and ``response_len_mean`` /
``response_len_max``. When rows carry a ``"phase"`` (e.g. ``"sft"`` then ``"rl"``) each phase's span is shaded and labelled on both panels. A metric that is absent or
``null`` (non-finite) at some steps leaves a gap; a run of a few steps is drawn with markers.
Lines that are not JSON (a half-written last line of a live or killed run) are skipped.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np

PHASE_COLORS = {"sft": "tab:orange", "rl": "tab:blue"}
FEW_STEPS = 30  # at most this many points: draw markers too


def read_metrics(path: Path) -> list[dict]:
    rows = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                rows.append(row)
    rows.sort(key=lambda r: r["step"])
    return rows


def series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """Steps and float values of ``key``, NaN where missing, null or not a number."""
    steps = np.array([r["step"] for r in rows], dtype=np.int64)
    vals = [r.get(key) for r in rows]
    vals = np.array([v if isinstance(v, int | float) and not isinstance(v, bool) else math.nan for v in vals], float)
    return steps, vals


def moving_average(vals: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last ``window`` points, NaNs ignored (NaN where the window has none)."""
    ok = np.isfinite(vals)
    csum = np.concatenate([[0.0], np.cumsum(np.where(ok, vals, 0.0))])
    ccnt = np.concatenate([[0], np.cumsum(ok)])
    idx = np.arange(len(vals))
    lo = np.maximum(idx + 1 - window, 0)
    total, count = csum[idx + 1] - csum[lo], ccnt[idx + 1] - ccnt[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def phase_spans(rows: list[dict]) -> list[tuple[str, int, int]]:
    """Contiguous ``(phase, first_step, last_step)`` runs of rows that carry a ``"phase"``."""
    spans: list[tuple[str, int, int]] = []
    for r in rows:
        phase = r.get("phase")
        if phase is None:
            continue
        if spans and spans[-1][0] == phase:
            spans[-1] = (phase, spans[-1][1], r["step"])
        else:
            spans.append((str(phase), r["step"], r["step"]))
    return spans


def _shade_phases(ax, spans, label: bool) -> None:
    for i, (phase, first, last) in enumerate(spans):
        # a span covers its steps up to the next span's start (half a step beyond a lone step)
        right = spans[i + 1][1] if i + 1 < len(spans) else last + 0.5
        color = PHASE_COLORS.get(phase, f"C{3 + i % 6}")
        ax.axvspan(first - 0.5 if i == 0 else first, right, color=color, alpha=0.08, lw=0)
        if label:
            ax.text(first, 1.0, f" {phase}", transform=ax.get_xaxis_transform(), va="top", ha="left", fontsize=9, color=color)


def _plot(ax, steps, vals, few: bool, **kw) -> bool:
    if not np.isfinite(vals).any():
        return False
    ax.plot(steps, vals, marker="o" if few else None, ms=3, **kw)
    return True


def plot(rows: list[dict], out: Path, title: str) -> Path:
    # (matplotlib imported here: ~0.8 s that a process which draws nothing, e.g. a multi-process run's other
    # processes, does not pay. A Figure of its own, not pyplot's: no pyplot import or global figure state, and
    # fixed margins instead of tight_layout, which draws the figure once more to measure it: every run draws
    # this at its end, 0.23 -> 0.13 s warm)
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    few = len(rows) <= FEW_STEPS
    spans = phase_spans(rows)
    fig = Figure(figsize=(9, 6.5))
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.08, top=0.93, hspace=0.08)
    ax_r, ax_l = fig.subplots(2, 1, sharex=True)

    steps, reward = series(rows, "reward_mean")
    window = max(1, min(50, len(rows) // 10))
    drew = _plot(ax_r, steps, reward, few, color="tab:blue", alpha=0.35 if window > 1 else 1.0, lw=1, label="reward_mean")
    if drew and window > 1:
        ax_r.plot(steps, moving_average(reward, window), color="tab:blue", lw=2, label=f"moving average ({window} steps)")
    if not drew:
        ax_r.text(0.5, 0.5, "no reward_mean logged", transform=ax_r.transAxes, ha="center", va="center", color="gray")
    tools = False          # multi-turn runs: tool calls per trajectory, and the calls that ran of all calls
    for key, color in (("env/tool_calls_mean", "tab:orange"), ("env/tool_success", "tab:purple")):
        s, v = series(rows, key)
        if np.isfinite(v).any():
            tools = True
            ax_r.plot(s, moving_average(v, window), color=color, lw=2,
                      label=key + (f" (moving average, {window} steps)" if window > 1 else ""))
    s, v = series(rows, "eval/accuracy")      # held-out evaluations (jaxrl.eval): points, not a moving average
    if np.isfinite(v).any():
        ok = np.isfinite(v)
        ax_r.plot(s[ok], v[ok], color="tab:red", marker="s", ms=5, lw=1.5, label="eval/accuracy (held out)")
    ax_r.set_ylabel("reward" + (" / tool calls, success" if tools else ""))

    drew_len = False
    for key, color in (("response_len_mean", "tab:green"), ("response_len_max", "tab:red")):
        s, v = series(rows, key)
        drew_len |= _plot(ax_l, s, v, few, color=color, lw=1.5, label=key)
    if not drew_len:
        ax_l.text(0.5, 0.5, "no response lengths logged", transform=ax_l.transAxes, ha="center", va="center", color="gray")
    ax_l.set_ylabel("response length (tokens)")
    ax_l.set_xlabel("step")

    for ax in (ax_r, ax_l):
        _shade_phases(ax, spans, label=ax is ax_r)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="lower right", fontsize=8)
    ax_l.xaxis.set_major_locator(MaxNLocator(integer=True))
    if len(rows) == 1:
        ax_l.set_xlim(rows[0]["step"] - 1, rows[0]["step"] + 1)
    fig.suptitle(title, fontsize=10)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    return out


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw ``run_dir/metrics.jsonl`` into ``out`` (default ``run_dir/curves.png``); ValueError if no rows."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise ValueError(f"{path.resolve()}: not found")
    rows = read_metrics(path)
    if not rows:
        raise ValueError(f"{path.resolve()}: no metrics rows")
    n = sum("reward_mean" in r for r in rows) or len(rows)       # RL steps (a final evaluation is a row of its own)
    title = f"{run_dir.resolve().name} — {n} step{'s' * (n != 1)}"
    return plot(rows, Path(out) if out is not None else run_dir / "curves.png", title)


def draw_run_curves(run_dir: str | Path) -> None:
    """`plot_run` at the end of a run, when it logged any step; a failure is a warning (a plot must never
    hide the run's own outcome)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists() or not path.stat().st_size:
        return
    try:
        plot_run(run_dir)
    except Exception as e:
        logging.getLogger("jaxrl.train").warning("could not draw %s: %s", (Path(run_dir) / "curves.png").resolve(), e)
