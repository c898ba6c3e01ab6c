"""A user's first run: how long until the first RL step's metrics, with step 0's shapes compiled on a thread beside
the warm start and the exact buckets after step 0 (`trainer.background_compile=true`, the default) and without; and the
default at XLA's own LLVM level 3 instead of the level 1 a CPU run compiles at (`jaxrl.runtime.cpu_compile_level`).

    scripts/venv.sh python scripts/bench_cold_start.py          # the quickstart, 2 runs of each mode, interleaved
    scripts/venv.sh python scripts/bench_cold_start.py --quick --out /tmp/cold.json     # tiny, 1 run of each
    scripts/venv.sh python scripts/docs.py                      # then re-render docs/benchmarks.md

Each run is `python -m jaxrl.train` on the built-in default (the quickstart recipe) with `steps=3`, its own
empty compilation cache (JAXRL_COMPILATION_CACHE_DIR: what a first run sees) and, for the figures to mean
anything, nothing else running. Measured from outside: the process's start to its exit; from the run's
metrics.jsonl: when each step ended (its `time`), the compilations that blocked it (`compiles`, `compile_s`),
those on the thread (`compiles_background`) and step 1's wait for the thread; from its output, the warm-up's
seconds. Both modes must train alike: the same rewards and losses at every step (a run rounds step 0's
rollout up to the cover shapes whichever mode; only the float32 log-probs, which the on-policy loss does not
read, differ by rounding); at LLVM level 3 the same rollouts, and the losses' and gradient norms' largest
relative difference from level 1's is recorded. Writes scripts/results/bench_cold_start.json (docs/benchmarks.md renders it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_harness import write_result  # noqa: E402
from jaxrl.train.summary import machine  # noqa: E402

OUT = ROOT / "scripts" / "results" / "bench_cold_start.json"
OUTPUTS = ("bench_cold_start*.json",)   # scripts/results/ (tests/test_docs.py): runs on other CPUs as _<machine>.json
# mode -> (its override, its XLA_FLAGS addition); "llvm3": the default mode at XLA's own LLVM level (3) instead of
# the level 1 `jaxrl.runtime.cpu_compile_level` gives a CPU run: what that level saves
MODES = {"background": ("trainer.background_compile=true", ""),
         "blocking": ("trainer.background_compile=false", ""),
         "llvm3": ("trainer.background_compile=true", "--xla_backend_optimization_level=3")}
STEPS = 3
# --quick: the suite's tiny runs (tests/train_runs.TINY) with the warm-up on
QUICK = ["warm_start.steps=3", "warm_start.batch_size=8", "algo.prompts_per_step=8", "algo.group_size=4",
         "rollout.max_new_tokens=12", "data.num_examples=400", "rewards.num_workers=0", "engine.max_batch=32",
         "engine.max_seq_len=128", "data.max_prompt_len=96"]
SAME = ("reward_mean", "response_len_mean", "pass_rate", "loss", "grad_norm")     # equal in both modes
ROLLOUT = ("reward_mean", "response_len_mean", "pass_rate")


def run(mode: str, extra: list[str], work: Path, index: int, cache: Path | None = None) -> dict:
    """One cold run of `mode` (with `cache`: on that compilation cache instead); its timings and metrics."""
    run_dir, cache = work / f"{mode}_{index}", cache or work / f"cache_{mode}_{index}"
    override, flags = MODES[mode]
    cmd = [sys.executable, "-m", "jaxrl.train", f"run_dir={run_dir}", f"steps={STEPS}", *extra, override]
    env = dict(os.environ, JAXRL_COMPILATION_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flags}".strip()
    print("$", " ".join(cmd[1:]), flush=True)
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    process_s = time.time() - t0
    if p.returncode:
        raise SystemExit(f"{mode}: exit status {p.returncode}\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    warm = re.search(r"warm-up: (\d+) rollout/update executables compiled in ([\d.]+) s", p.stdout + p.stderr)
    out = {"mode": mode, "process_s": process_s, "step_end_s": [r["time"] - t0 for r in rows],
           "warmup_s": float(warm.group(2)) if warm else None, "warmup_executables": int(warm.group(1)) if warm else None,
           "compiles": [r["compiles"] for r in rows], "compile_s": [r["compile_s"] for r in rows],
           "compiles_background": sum(r.get("compiles_background", 0) for r in rows),
           "background_wait_s": rows[1].get("warmup/background_wait_s") if len(rows) > 1 else None,
           "rollout_s": [r["rollout_s"] for r in rows], "metrics": {k: [r[k] for r in rows] for k in SAME}}
    print(f"  {mode}: step 0 ends at {out['step_end_s'][0]:.1f} s, process {process_s:.1f} s", flush=True)
    return out


def summarize(runs: list[dict]) -> dict:
    """Medians per mode, the first step's speed-up (blocking / background) and whether both trained alike."""
    med = lambda mode, f: float(np.median([f(r) for r in runs if r["mode"] == mode]))  # noqa: E731
    modes = {m: {"first_step_s": med(m, lambda r: r["step_end_s"][0]),
                 "second_step_s": med(m, lambda r: r["step_end_s"][1]),
                 "process_s": med(m, lambda r: r["process_s"]),
                 "step0_blocking_compiles": med(m, lambda r: r["compiles"][0]),
                 "later_blocking_compiles": med(m, lambda r: sum(r["compiles"][1:])),
                 "background_compiles": med(m, lambda r: r["compiles_background"])} for m in MODES}
    level1 = [r["metrics"] for r in runs if r["mode"] != "llvm3"]
    level3 = [r["metrics"] for r in runs if r["mode"] == "llvm3"]
    rel = lambda a, b: abs(a - b) / max(abs(a), abs(b), 1e-30)          # noqa: E731
    return {"modes": modes, "first_step_speedup": modes["blocking"]["first_step_s"] / modes["background"]["first_step_s"],
            "process_ratio": modes["background"]["process_s"] / modes["blocking"]["process_s"],
            "same_training": all(m == level1[0] for m in level1),
            "llvm3_first_step_ratio": modes["llvm3"]["first_step_s"] / modes["background"]["first_step_s"],
            "llvm3_process_ratio": modes["llvm3"]["process_s"] / modes["background"]["process_s"],
            # level 3 against level 1: rollouts (rewards, lengths) equal; losses and gradient norms by rounding
            "llvm3_same_rollouts": all(m[k] == level1[0][k] for m in level3 for k in ROLLOUT),
            "llvm3_max_rel_diff": {k: max((rel(a, b) for m in level3 for a, b in zip(m[k], level1[0][k])), default=0.0)
                                   for k in SAME if k not in ROLLOUT}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=2, help="runs of each mode, interleaved (default 2)")
    ap.add_argument("--quick", action="store_true", help="the tiny test-size run, once per mode (a smoke test)")
    ap.add_argument("--cache", type=Path, help="every run on this compilation cache: no cold start (a smoke test "
                    "of the runs' equality and compile counts, not of their times)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    repeats, extra = (1, QUICK) if args.quick else (args.repeats, [])
    result = {"machine": machine(), "loadavg_before": list(os.getloadavg()), "steps": STEPS, "quick": args.quick,
              "cold": args.cache is None,
              "command": "python -m jaxrl.train run_dir=... steps=3" + " ".join([""] + extra)
              + " trainer.background_compile=true|false", "modes": MODES, "runs": []}
    with tempfile.TemporaryDirectory(prefix="cold_start_") as work:
        for i in range(repeats):
            for mode in (("blocking", "background", "llvm3") if i % 2 == 0 else ("llvm3", "background", "blocking")):
                result["runs"].append(run(mode, extra, Path(work), i, args.cache))
    result["loadavg_after"] = list(os.getloadavg())
    result["summary"] = summarize(result["runs"])
    write_result(args.out, result)
    s = result["summary"]
    print(f"-> {args.out}\nfirst step: {s['modes']['blocking']['first_step_s']:.1f} s blocking, "
          f"{s['modes']['background']['first_step_s']:.1f} s background ({s['first_step_speedup']:.2f}x); "
          f"process {s['process_ratio']:.2f}x; same training: {s['same_training']}; at LLVM level 3: first step "
          f"{s['llvm3_first_step_ratio']:.2f}x, process {s['llvm3_process_ratio']:.2f}x, same rollouts "
          f"{s['llvm3_same_rollouts']}, max relative difference {s['llvm3_max_rel_diff']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
