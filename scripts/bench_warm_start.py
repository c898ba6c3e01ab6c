"""A second run: the quickstart again on the compilation cache a first run filled, with its executables loaded
from `jaxrl.executable_store` (the default) and without it (JAXRL_EXECUTABLE_STORE=0: each program traced
and lowered, then loaded from JAX's persistent cache), interleaved.

    scripts/venv.sh python scripts/bench_warm_start.py            # the quickstart, 2 runs of each, interleaved
    scripts/venv.sh python scripts/bench_warm_start.py --quick --out /tmp/warm.json     # tiny, 1 run of each
    scripts/venv.sh python scripts/docs.py                        # then re-render docs/benchmarks.md

Each run is `python -m jaxrl.train` on the built-in default with `steps=3` (as scripts/bench_cold_start.py, whose
`run` this uses), all on one cache that a first run filled (cold, not counted), each with its own
`jaxrl.compile_log`: the seconds its processes spent tracing, lowering, compiling and loading programs, and those of
the rollout's prefill and decode steps apart. Both modes must train alike: the same metrics at every step.
Writes scripts/results/bench_warm_start.json (docs/benchmarks.md renders it).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_harness import write_result  # noqa: E402
from jaxrl import compile_log  # noqa: E402
from jaxrl.train.summary import machine  # noqa: E402
from scripts.bench_cold_start import QUICK, STEPS, run  # noqa: E402

OUT = ROOT / "scripts" / "results" / "bench_warm_start.json"
OUTPUTS = ("bench_warm_start.json",)   # its files in scripts/results/ (tests/test_docs.py)
MODES = {"store": "1", "no_store": "0"}            # mode -> JAXRL_EXECUTABLE_STORE
ROLLOUT_STEPS = ("prefill_step", "decode_step")
KINDS = ("trace", "lower", "compile", "load")


def logged(directory: Path) -> dict:
    """The run's program-building seconds and counts: all programs, and the rollout steps alone."""
    rows = compile_log.read(directory)
    rollout = [r for r in rows if compile_log._program(r) in ROLLOUT_STEPS]
    total = lambda rs: {k: round(sum(r["s"] for r in rs if compile_log._kind(r) == k), 2) for k in KINDS}  # noqa: E731
    count = lambda rs: {k: sum(compile_log._kind(r) == k for r in rs) for k in KINDS}  # noqa: E731
    return {"seconds": total(rows), "counts": count(rows), "rollout_seconds": total(rollout),
            "rollout_counts": count(rollout)}


def one(mode: str, extra: list[str], work: Path, index, cache: Path) -> dict:
    log = work / f"log_{mode}_{index}"
    saved = {k: os.environ.get(k) for k in ("JAXRL_EXECUTABLE_STORE", "JAXRL_COMPILE_LOG")}
    os.environ.update(JAXRL_EXECUTABLE_STORE=MODES[mode], JAXRL_COMPILE_LOG=str(log))
    try:                       # (the run inherits them; this process, e.g. a test's, gets its own back)
        out = run("background", extra, work, f"{mode}_{index}", cache)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return {**out, "mode": mode, "programs": logged(log)}


def summarize(runs: list[dict]) -> dict:
    med = lambda mode, f: float(np.median([f(r) for r in runs if r["mode"] == mode]))  # noqa: E731
    modes = {m: {"first_step_s": med(m, lambda r: r["step_end_s"][0]), "process_s": med(m, lambda r: r["process_s"]),
                 **{f"{k}_s": med(m, lambda r, k=k: r["programs"]["seconds"][k]) for k in KINDS},
                 **{f"rollout_{k}_s": med(m, lambda r, k=k: r["programs"]["rollout_seconds"][k]) for k in KINDS},
                 "rollout_traces": med(m, lambda r: r["programs"]["rollout_counts"]["trace"]),
                 "rollout_loads": med(m, lambda r: r["programs"]["rollout_counts"]["load"])} for m in MODES}
    first = [r["metrics"] for r in runs]
    return {"modes": modes, "first_step_ratio": modes["store"]["first_step_s"] / modes["no_store"]["first_step_s"],
            "process_ratio": modes["store"]["process_s"] / modes["no_store"]["process_s"],
            "same_training": all(m == first[0] for m in first)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=2, help="runs of each mode, interleaved (default 2)")
    ap.add_argument("--quick", action="store_true", help="the tiny test-size run, once per mode (a smoke test)")
    ap.add_argument("--cache", type=Path, help="every run on this compilation cache (a smoke test of the runs' "
                    "equality and counts, not of their times)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    repeats, extra = (1, QUICK) if args.quick else (args.repeats, [])
    result = {"machine": machine(), "loadavg_before": list(os.getloadavg()), "steps": STEPS, "quick": args.quick,
              "command": "python -m jaxrl.train run_dir=... steps=3" + " ".join([""] + extra), "runs": []}
    with tempfile.TemporaryDirectory(prefix="warm_start_") as work:
        work, cache = Path(work), args.cache or Path(work) / "cache"
        prime = one("store", extra, work, "prime", cache)          # (cold) fills JAX's cache and the store
        result["prime"] = {"first_step_s": prime["step_end_s"][0], "process_s": prime["process_s"],
                           "programs": prime["programs"]}
        for i in range(repeats):
            for mode in (("no_store", "store") if i % 2 == 0 else ("store", "no_store")):
                result["runs"].append(one(mode, extra, work, i, cache))
    result["loadavg_after"] = list(os.getloadavg())
    result["summary"] = s = summarize(result["runs"])
    write_result(args.out, result)
    m = s["modes"]
    print(f"-> {args.out}\nfirst step: {m['store']['first_step_s']:.1f} s with the store, "
          f"{m['no_store']['first_step_s']:.1f} s without ({s['first_step_ratio']:.2f}x); process "
          f"{s['process_ratio']:.2f}x; rollout steps traced {m['no_store']['rollout_trace_s']:.1f} -> "
          f"{m['store']['rollout_trace_s']:.1f} s, lowered {m['no_store']['rollout_lower_s']:.1f} -> "
          f"{m['store']['rollout_lower_s']:.1f} s; same training: {s['same_training']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
