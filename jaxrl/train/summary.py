"""`RUN_DIR/summary.json`: a run's headline figures, written by `python -m jaxrl.train` when the run ends.

These are the figures of the README's quickstart table. `scripts/docs.py` renders that table from
`scripts/results/quickstart.json`, a copy of a quickstart run's `summary.json`, so the table is never typed
by hand:

    scripts/venv.sh python scripts/quickstart_results.py quickstart    # runs it, copies summary.json there
    scripts/venv.sh python scripts/docs.py

Everything but `wall_s` comes from `metrics.jsonl`, so a resumed run's figures cover the whole run from
step 0. `wall_s` is this process's time from `main()` to the end, after the venv check (which runs before
Python) and before nothing else: compilation, the warm start, every RL step, checkpoints and the HF export.
For a resumed run it covers only the last invocation (`resumed: true` says so). "First/last 20%" are the
first and last max(1, steps // 5) RL steps, as in the run's closing line (`metrics.run_summary`).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from jaxrl.train.metrics import read_rows


def machine() -> dict:
    """Where the run ran: OS platform string, CPU model (from /proc/cpuinfo; `platform.processor()`
    elsewhere) and its `cpu_id`, logical CPUs in the machine and those this process may use."""
    cpu = _cpuinfo().get("model name", "")
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:                                  # not on Linux
        usable = os.cpu_count()
    return {"platform": platform.platform(), "cpu": cpu or platform.processor() or "unknown", "cpu_id": cpu_id(),
            "cpu_count": os.cpu_count(), "cores": usable, "python": platform.python_version()}


def commit() -> dict | None:
    """The code that ran: the git commit of this checkout and whether its tracked files had changes (`dirty`);
    None outside a git checkout (an installed package) or without git."""
    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        diff = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if sha.returncode or diff.returncode:
        return None
    return {"sha": sha.stdout.strip(), "dirty": bool(diff.stdout.strip())}


# the flags that change the code XLA:CPU emits (its LLVM target features): vector widths, FMA, bf16/int8 dots
_ISA = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni",
        "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


def cpu_id() -> str:
    """The CPU as far as float32 rounding can tell: XLA:CPU compiles for the host's vector ISA, and the matmul
    blocking that orders a dot's sums follows the cache sizes, so two CPUs of one model name (/proc/cpuinfo
    says "AMD EPYC" for several Zen generations) can round alike only if all of these match. Model name,
    family/model/stepping, cache sizes (cpu0's, from /sys) and the ISA flags in `_ISA` that are set; "" where
    /proc/cpuinfo is absent (not Linux). A golden record kept per CPU (tests/golden/flow_default.json) keys on
    this."""
    info = _cpuinfo()
    if not info:
        return ""
    caches = []
    for d in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level, kind, size = ((d / f).read_text().strip() for f in ("level", "type", "size"))
        except OSError:
            continue
        caches.append(f"L{level}{kind[0].lower() if kind != 'Unified' else ''} {size}")
    flags = set(info.get("flags", "").split())
    return "; ".join([info.get("model name", "?"),
                      f"family {info.get('cpu family', '?')} model {info.get('model', '?')} "
                      f"stepping {info.get('stepping', '?')}",
                      " ".join(caches) or f"cache {info.get('cache size', '?')}",
                      " ".join(f for f in _ISA if f in flags)])


def _cpuinfo() -> dict:
    """/proc/cpuinfo's first processor block as {field: value}; {} where it cannot be read."""
    try:
        block = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in block.splitlines())}


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _num(row: dict, key: str) -> float | None:
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _values(rows: list[dict], key: str) -> list[float]:
    return [v for v in (_num(r, key) for r in rows) if v is not None]


def eval_summary(rows: list[dict]) -> dict:
    """The held-out evaluations of `rows` (`jaxrl.eval`): each one's step and eval/ metrics, and the accuracy
    of the first and the last; {} for a run without evaluation."""
    evals = [{k: v for k, v in r.items() if k == "step" or k.startswith("eval/")} for r in rows
             if _num(r, "eval/accuracy") is not None]
    if not evals:
        return {}
    return {"eval_accuracy_first": evals[0]["eval/accuracy"], "eval_accuracy_last": evals[-1]["eval/accuracy"],
            "evals": evals}


def summarize(rows: list[dict], wall_s: float | None = None) -> dict:
    """The summary of the RL steps in `rows` (the rows of `metrics.jsonl` that carry `reward_mean`), and of its
    held-out evaluations (`eval_summary`) when it has any."""
    evals = eval_summary(rows)
    rows = [r for r in rows if _num(r, "reward_mean") is not None]
    n = len(rows)
    k = max(1, n // 5)
    first, last = rows[:k], rows[-k:]

    def median(key):
        vals = _values(rows, key)
        return statistics.median(vals) if vals else None

    lens_max = _values(rows, "response_len_max")
    return {
        "steps": n,
        "first_step": rows[0]["step"] if rows else None,
        "last_step": rows[-1]["step"] if rows else None,
        "window_steps": k if rows else 0,
        "wall_s": wall_s,
        "step_seconds_median": median("step_seconds"),
        "rollout_s_median": median("rollout_s"),
        "reward_s_median": median("reward_s"),
        "train_s_median": median("train_s"),
        "reward_mean_first": _mean(_values(first, "reward_mean")),
        "reward_mean_last": _mean(_values(last, "reward_mean")),
        "pass_rate_first": _mean(_values(first, "pass_rate")),
        "pass_rate_last": _mean(_values(last, "pass_rate")),
        "response_len_mean": _mean(_values(rows, "response_len_mean")),
        "response_len_max": max(lens_max) if lens_max else None,
        "compiles_after_step0": sum(_values(rows[1:], "compiles")),
        **evals,
    }


def write_summary(run_dir: str | Path, wall_s: float | None, *, resumed: bool = False,
                  argv: list[str] | None = None, code: dict | None = None) -> Path:
    """Write `run_dir/summary.json` (atomically) from its `metrics.jsonl`; returns the path. `code`: the run's
    `commit()` as it started (default: now)."""
    run_dir = Path(run_dir)
    out = {"command": " ".join(["python -m jaxrl.train", *(sys.argv[1:] if argv is None else argv)]),
           **summarize(read_rows(run_dir), wall_s), "resumed": resumed, "machine": machine(),
           "commit": code if code is not None else commit()}
    path = run_dir / "summary.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(out, indent=1) + "\n")
    os.replace(tmp, path)
    return path
