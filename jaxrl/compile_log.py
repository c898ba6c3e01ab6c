"""Where a process's program-building time goes: one JSON line per traced, lowered and compiled program.

    JAXRL_COMPILE_LOG=DIR python -m jaxrl.train ...     # every process writes DIR/<pid>.jsonl
    python -m jaxrl.compile_log DIR                      # totals, by program and by test

JAX reports the duration of each jaxpr trace, each lowering to StableHLO and each backend compilation
(`jax.monitoring`, with the function's name); a compilation served by the persistent cache reports a cache hit
first, so the log tells a compilation (`hit: false`) from a load (`hit: true`, which includes the wait for
another process's compilation of the same program: `jaxrl.runtime`'s compile lock). Each line also names the
pytest test that was running (`PYTEST_CURRENT_TEST`, which the processes a test starts inherit) and the thread, so
`scripts/suite_time.py` can say which tests the suite's trace, lower and compile seconds went to.

Durations are wall seconds in the thread that recorded them: on a machine busier than its cores they include
waiting for a core, and where a process builds programs on several threads at once (a warm-up's compile
workers, background compilation) they overlap and include waits for the GIL, so their sum bounds the CPU time
spent rather than measuring it. `start` is called by `jaxrl.runtime.enable_compilation_cache` (every entry point
and the test session) when JAXRL_COMPILE_LOG is set; nothing is recorded otherwise.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time
from pathlib import Path

from jax._src import monitoring

EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "compile"}
HIT = "/jax/compilation_cache/cache_hits"


class CompileLog:
    """The listeners writing one process's lines to `directory/<pid>.jsonl` (`stop` removes them)."""

    def __init__(self, directory: str | os.PathLike):
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / f"{os.getpid()}.jsonl"
        self._file = open(self.path, "a", buffering=1)
        self._hit = threading.local()            # a cache hit is reported inside its compile event's span
        self._lock = threading.Lock()
        monitoring.register_event_listener(self._on_event)
        monitoring.register_event_duration_secs_listener(self._on_duration)

    def _on_event(self, event: str, **_):
        if event == HIT:
            self._hit.value = True

    def _on_duration(self, event: str, duration: float, **kw):
        kind = EVENTS.get(event)
        if kind is None:
            return
        row = {"t": round(time.time(), 3), "event": kind, "fn": kw.get("fun_name"), "s": round(duration, 4),
               "test": os.environ.get("PYTEST_CURRENT_TEST"), "thread": threading.current_thread().name}
        if kind == "compile":
            row["hit"] = getattr(self._hit, "value", False)
            self._hit.value = False
        with self._lock:
            self._file.write(json.dumps(row) + "\n")

    def stop(self) -> None:
        monitoring.unregister_event_listener(self._on_event)
        monitoring.unregister_event_duration_listener(self._on_duration)
        self._file.close()


_STARTED: CompileLog | None = None


def start(directory: str | os.PathLike | None = None) -> CompileLog | None:
    """Log this process's programs to `directory` (default: JAXRL_COMPILE_LOG; neither: nothing). Once per
    process: a second call returns the running log."""
    global _STARTED
    directory = directory or os.environ.get("JAXRL_COMPILE_LOG")
    if _STARTED is None and directory:
        _STARTED = CompileLog(directory)
    return _STARTED


def read(directory: str | os.PathLike) -> list[dict]:
    """Every line of every process's log in `directory` (a line cut short by a killed process, and files not
    named by a process id, are skipped)."""
    rows = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        if not path.stem.isdigit():
            continue
        for line in path.read_text().splitlines():
            try:
                rows.append({**json.loads(line), "pid": int(path.stem)})
            except json.JSONDecodeError:
                continue
    return rows


def _program(row: dict) -> str:
    """The function's name: a trace reports `f`, its lowering and compilation `jit(f)`."""
    name = row["fn"] or "-"
    return name[4:-1] if name.startswith("jit(") and name.endswith(")") else name


def _kind(row: dict) -> str:
    return row["event"] if row["event"] != "compile" else ("load" if row["hit"] else "compile")


def summarize(rows: list[dict], top: int = 10) -> dict:
    """Seconds and counts of trace, lower, compile (a cache miss) and load (a cache hit) in all, and the `top`
    programs and tests by their sum. A test is its node id (pytest's phase suffix dropped); "-" outside one."""
    kinds = ("trace", "lower", "compile", "load")
    total = {k: 0.0 for k in kinds}
    count = collections.Counter()
    by_fn, by_test = collections.defaultdict(collections.Counter), collections.defaultdict(collections.Counter)
    processes = collections.defaultdict(set)
    for r in rows:
        k = _kind(r)
        total[k] += r["s"]
        count[k] += 1
        test = (r.get("test") or "-").rsplit(" (", 1)[0]
        by_fn[_program(r)][k] += r["s"]
        by_test[test][k] += r["s"]
        processes[test].add(r["pid"])

    def ranked(table, extra=None):
        best = sorted(table.items(), key=lambda kv: -sum(kv[1].values()))[:top]
        return [{"name": name, **{k: round(c[k], 2) for k in kinds}, **(extra(name) if extra else {})}
                for name, c in best]

    return {"seconds": {k: round(v, 2) for k, v in total.items()}, "counts": {k: count[k] for k in kinds},
            "processes": len({r["pid"] for r in rows}), "by_program": ranked(by_fn),
            "by_test": ranked(by_test, lambda name: {"processes": len(processes[name])})}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python -m jaxrl.compile_log DIR   (DIR: what JAXRL_COMPILE_LOG named)", file=sys.stderr)
        return 2
    s = summarize(read(argv[0]))
    print(f"{s['processes']} processes: " + ", ".join(f"{k} {v:.1f} s ({s['counts'][k]})"
                                                       for k, v in s["seconds"].items()))
    for title, key in (("programs", "by_program"), ("tests", "by_test")):
        print(f"\n{title} (trace / lower / compile / load seconds):")
        for r in s[key]:
            print(f"  {r['trace']:7.1f} {r['lower']:7.1f} {r['compile']:7.1f} {r['load']:7.1f}  {r['name']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
