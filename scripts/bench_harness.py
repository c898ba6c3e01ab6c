"""What every `scripts/bench_*.py` shares: the provenance record each result JSON carries, the writer that adds
it, and the interleaved side-by-side timer.

    from bench_harness import interleaved, write_result

    rounds = interleaved({"full": full_step, "blockwise": block_step}, repeats=5, warmup=1)
    write_result(path, {"full_s": min(rounds.seconds["full"]), ...})

The record, under the key `PROVENANCE` of every result: the machine (`jaxrl.train.summary.machine()`: CPU model,
its `cpu_id`, cores; plus the CPU flags that change the code XLA:CPU emits and the JAX version), the commit and
whether tracked files had changes (`jaxrl.train.summary.commit()`), the UTC date and the command line.
`scripts/docs.py` names the machine from it where a result has no `machine` of its own, and `tests/test_docs.py`
fails on a rendered block whose JSON records no machine or no commit.

A result a script merges into an existing file (`bench_sim_cluster.py --only`, `bench_lora.py --only`) gets the
record of the run that wrote it last: the entries kept from the file are not told apart.

Not imported by the packages (scripts are leaves). Imports no JAX itself: the scripts choose the platform first.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:                     # `jaxrl` and `models` for the scripts that import this first
    sys.path.insert(0, str(ROOT))

PROVENANCE = "provenance"

# the /proc/cpuinfo flags that change XLA:CPU's code for the figures here: vector width, FMA, bf16 dots and tiles
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_flags() -> list[str]:
    try:
        block = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return []
    flags = next((v for k, _, v in (line.partition(":") for line in block.splitlines()) if k.strip() == "flags"), "")
    return [f for f in CPU_FLAGS if f in flags.split()]


def provenance() -> dict:
    """Where and what this process measures: {"machine", "commit" ({"sha", "dirty"}, or None outside a git
    checkout), "date" (UTC, ISO 8601), "command"}."""
    from jaxrl.train.summary import commit, machine

    return {"machine": {**machine(), "cpu_flags": _cpu_flags(), "jax": _version("jax"), "jaxlib": _version("jaxlib")},
            "commit": commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join([Path(sys.executable).name, *sys.argv])}


def write_result(path: str | Path, result: dict, *, indent: int | None = 1, default=None) -> Path:
    """Set `result[PROVENANCE]` to this process's `provenance()` (replacing the record of a file the result was
    merged from), so that `result` is what the file holds, and write it as JSON to `path` (its folder made);
    `indent` and `default` as `json.dumps` takes them. Returns the path."""
    result[PROVENANCE] = provenance()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=indent, default=default) + "\n")
    return path


@dataclasses.dataclass(frozen=True)
class Rounds:
    """`interleaved`'s timed rounds: each run's seconds and return values, in round order."""
    seconds: dict[str, list[float]]
    results: dict[str, list]


def interleaved(runs: Mapping[str, Callable[..., Any]], repeats: int, *, warmup: int = 0,
                prepare: Mapping[str, Callable[[], tuple]] | None = None,
                sync: Callable[[Any], Any] | None = None,
                on_call: Callable[[str, int, float, Any], None] | None = None) -> Rounds:
    """Time `runs` side by side: `warmup` untimed rounds, then `repeats` timed ones, each round calling every
    run once in order, so slow drifts of the machine (load, clocks) hit all alike. Per call,
    `prepare[name]()` (untimed) gives the run's arguments; `sync(result)` (timed: e.g. `jax.block_until_ready`)
    waits for its work; `on_call(name, round, seconds, result)` sees every call, warm-up rounds (round <
    warmup) included."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats} warmup={warmup}")
    prepare = prepare or {}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    results: dict[str, list] = {name: [] for name in runs}
    for r in range(warmup + repeats):
        for name, fn in runs.items():
            args = prepare[name]() if name in prepare else ()
            t0 = time.perf_counter()
            out = fn(*args)
            if sync is not None:
                sync(out)
            dt = time.perf_counter() - t0
            if on_call is not None:
                on_call(name, r, dt, out)
            if r >= warmup:
                seconds[name].append(dt)
                results[name].append(out)
    return Rounds(seconds, results)
