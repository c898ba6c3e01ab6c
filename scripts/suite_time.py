"""How long the test suite takes as CI runs it: a clean clone of this repository's HEAD, its own virtual
environment, an empty persistent compilation cache (what a fresh CI machine sees), `bash .ci/run` verbatim.

    scripts/venv.sh python scripts/suite_time.py               # ~30-60 min on 2 cores; progress on stdout
    scripts/venv.sh python scripts/suite_time.py --warm DIR    # reuse compilation cache DIR instead

Writes scripts/results/suite_time.json: wall time (venv install included) and pytest's own time, the CPU time
of everything the run started (so the cores kept busy), pass/fail counts, the 25 slowest test phases, the
time per test file (every phase's duration: PYTEST_ADDOPTS=--durations=0, which .ci/run's pytest reads) and
each test's CPU seconds (tests/conftest.py's "most CPU" list, per test and per file), and where the programs'
building time went (`jaxrl.compile_log`, on for the run: seconds of tracing, lowering, compiling and loading
from the cache, in all, by program and by test).
docs/testing.md renders it (`scripts/docs.py`). The clone, its venv and its cache are removed afterwards.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "scripts" / "results" / "suite_time.json"
OUTPUTS = ("suite_time.json",)       # its files in scripts/results/ (tests/test_docs.py)
BUDGET_S = 20 * 60                   # issue 33: the whole suite in 20 minutes on 2 cores, empty cache
DURATION = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(\S+)")
CPU = re.compile(r"^\s*([0-9.]+)s cpu\s+(\S+)")       # tests/conftest.py's "most CPU" list
SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed|error).*) in ([0-9.]+)s")
COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)")


def machine() -> dict:
    sys.path.insert(0, str(ROOT))
    from jaxrl.train.summary import machine as where    # (no JAX import: a plain description of the host)

    return where()


def parse(log: str) -> dict:
    """Counts, pytest's time, slowest phases, per-file totals and each test's CPU seconds from a pytest log
    with --durations=0."""
    phases = [(float(m.group(1)), m.group(2), m.group(3)) for m in map(DURATION.match, log.splitlines()) if m]
    summary = [m for m in map(SUMMARY.search, log.splitlines()) if m]
    if not summary:
        raise SystemExit("no pytest summary line in the log: the run did not finish")
    counts = {kind.rstrip("s") if kind.startswith("error") else kind: int(n)
              for n, kind in COUNT.findall(summary[-1].group(1))}
    by_file, cpu_by_file = collections.Counter(), collections.Counter()
    for s, _, node in phases:
        by_file[node.split("::")[0]] += s
    cpu = [(float(m.group(1)), m.group(2)) for m in map(CPU.match, log.splitlines()) if m]
    for s, node in cpu:
        cpu_by_file[node.split("::")[0]] += s
    ranked = lambda c: dict(sorted(((f, round(s, 2)) for f, s in c.items()), key=lambda kv: -kv[1]))  # noqa: E731
    return {"counts": counts, "pytest_s": float(summary[-1].group(2)),
            "slowest": [{"s": s, "phase": when, "test": node} for s, when, node in sorted(phases, reverse=True)[:25]],
            "by_file_s": ranked(by_file), "phases_s": round(sum(s for s, _, _ in phases), 2),
            # CPU seconds per test (tests/conftest.py: the worker's and the processes it waited for)
            "cpu_slowest": [{"cpu_s": s, "test": node} for s, node in sorted(cpu, reverse=True)[:25]],
            "cpu_by_file_s": ranked(cpu_by_file), "tests_cpu_s": round(sum(s for s, _ in cpu), 1)}


def programs(log_dir: Path) -> dict:
    """`jaxrl.compile_log`'s summary of every process the run started (wall seconds in each thread)."""
    sys.path.insert(0, str(ROOT))
    from jaxrl import compile_log

    return compile_log.summarize(compile_log.read(log_dir)) if log_dir.is_dir() else {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--warm", type=Path, help="compilation cache to use (default: a new, empty one)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="suite_time-"))
    try:
        subprocess.run(["git", "clone", "-q", str(ROOT), str(work / "repo")], check=True)
        cache = args.warm.resolve() if args.warm else work / "xla"
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "JAXRL_VENV", "PYTEST_ADDOPTS")}
        env.update(JAXRL_COMPILATION_CACHE_DIR=str(cache), PYTEST_ADDOPTS="--durations=0", CI="true",
                   JAXRL_COMPILE_LOG=str(work / "compile_log"))
        log_path = work / "ci.log"
        print(f"[suite_time] {commit[:10]} in {work / 'repo'}, cache {cache}; log {log_path}", flush=True)
        t0, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        with open(log_path, "w") as log:
            p = subprocess.Popen(["bash", ".ci/run"], cwd=work / "repo", env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
            for line in p.stdout:                 # progress: pytest's dots, as they come
                log.write(line)
                sys.stdout.write(line)
                sys.stdout.flush()
            status = p.wait()
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        result = {"commit": commit, "command": "bash .ci/run (a clean clone; PYTEST_ADDOPTS=--durations=0)",
                  "cache": "warm: " + str(args.warm) if args.warm else "empty", "exit_status": status,
                  "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "cores_busy": round(cpu / wall, 2),
                  "budget_s": BUDGET_S, "machine": machine(), **parse(log_path.read_text()),
                  "programs": programs(work / "compile_log")}
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"[suite_time] exit {status}: {wall / 60:.1f} min wall, {cpu / 60:.1f} CPU-min -> {args.out}")
        if status:
            shutil.copy(log_path, Path(tempfile.gettempdir()) / "suite_time_failed.log")
        return status
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
