"""The learning check of asynchronous RL at quickstart size: does generation k = 2 versions ahead (the decoupled
objective, each update swapped into the next rollout mid-way) reach the synchronous run's reward?

    scripts/venv.sh python scripts/bench_async.py                # both runs, one after the other (~10 min, 2 cores)
    scripts/venv.sh python scripts/bench_async.py --from sync=runs/async_sync --from k2=runs/async_k2   # no run
    scripts/venv.sh python scripts/docs.py                       # then re-render docs/async.md

Both runs are the quickstart (`python -m jaxrl.train`: its model, tasks, warm start and 250 RL steps) on StreamRL's
disaggregated pools (4 generation instances, an fsdp=4 train mesh), into runs/async_<name> (the script stops if
that directory exists: the trainer would resume it):
  * sync — max_staleness=0: each rollout on the newest weights;
  * k2   — max_staleness=2, algo.objective=decoupled (importance weights truncated at 2), trainer.swap_step=16 (the
           update enters the next rollout at its 16th engine step, the K/V kept).
It writes scripts/results/bench_async.json (each run's per-step reward, staleness and importance-weight
statistics, the mean reward over the first and last 20% of the steps, wall time) and bench_async.png (the
reward curves side by side, a 20-step moving mean). The verdict: k2's last-20% reward within MARGIN of sync's.
On 2 shared CPU cores the two pools cannot run at the same time, so wall time says nothing of the speed-up
(that is the simulator's); the check here is that learning on stale samples, corrected, still learns.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_harness import write_result  # noqa: E402
from jaxrl.train.summary import machine  # noqa: E402

RESULTS = ROOT / "scripts" / "results"
OUT, PNG = RESULTS / "bench_async.json", RESULTS / "bench_async.png"
OUTPUTS = ("bench_async.json", "bench_async.png")   # its files in scripts/results/ (tests/test_docs.py)
POOLS = ["placement=disaggregated", "engine.instances=4", "train_layout.fsdp=4"]
RUNS = {"sync": POOLS,
        "k2": POOLS + ["trainer.max_staleness=2", "algo.objective=decoupled", "trainer.swap_step=16"]}
MARGIN = 0.05          # |k2's last-20% mean reward − sync's| at most this counts as "reaches"
SMOOTH = 20


def command(name: str, run_dir: Path) -> list[str]:
    return [str(ROOT / "scripts" / "venv.sh"), "python", "-m", "jaxrl.train", f"run_dir={run_dir}", *RUNS[name]]


def run(name: str) -> Path:
    run_dir = ROOT / "runs" / f"async_{name}"
    if run_dir.exists():
        raise SystemExit(f"{run_dir} exists (the trainer would resume it): remove it, or pass --from {name}={run_dir}")
    cmd = command(name, run_dir)
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    if subprocess.run(cmd, cwd=ROOT).returncode:
        raise SystemExit(f"{name}: the run failed")
    print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    return run_dir


def measure(name: str, run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((run_dir / "summary.json").read_text())
    get = lambda k: [r.get(k) for r in rows]        # noqa: E731
    return {"command": " ".join(command(name, Path(f"runs/async_{name}"))).replace(str(ROOT) + "/", ""),
            "steps": len(rows), "wall_s": summary["wall_s"], "reward_mean_first": summary["reward_mean_first"],
            "reward_mean_last": summary["reward_mean_last"], "reward": get("reward_mean"),
            "staleness": get("placement/staleness"), "staleness_mean": get("async/staleness_mean"),
            "is_weight_mean": get("async/is_weight_mean"), "is_weight_max": get("async/is_weight_max"),
            "is_truncated_frac": get("async/is_truncated_frac"), "gen_wait_s": get("async/gen_wait_s")}


def plot(data: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for name, r in data["runs"].items():
        y = np.asarray(r["reward"], np.float64)
        smooth = np.convolve(y, np.ones(SMOOTH) / SMOOTH, mode="valid")
        extra = [x for x in RUNS[name] if x not in POOLS] or ["trainer.max_staleness=0"]
        ax.plot(np.arange(len(smooth)) + SMOOTH - 1, smooth, label=f"{name}: " + ", ".join(
            x.split(".")[-1] for x in extra) + f" (last 20%: {r['reward_mean_last']:.3f})")
    ax.set_xlabel("RL step")
    ax.set_ylabel(f"reward ({SMOOTH}-step mean)")
    ax.set_title("quickstart on disaggregated pools: synchronous vs 2 versions ahead", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    ax.text(0.99, 0.02, data["machine"]["cpu"], transform=ax.transAxes, ha="right", fontsize=6, color="gray")
    fig.tight_layout()
    fig.savefig(PNG, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--from", dest="sources", action="append", default=[], metavar="NAME=RUN_DIR",
                    help="take a finished run directory instead of running NAME")
    args = ap.parse_args(argv)
    sources = dict(s.split("=", 1) for s in args.sources)
    bad = [n for n in sources if n not in RUNS]
    if bad:
        raise SystemExit(f"unknown run(s) {bad}; known: {list(RUNS)}")
    runs = {name: measure(name, Path(sources[name]) if name in sources else run(name)) for name in RUNS}
    gap = runs["k2"]["reward_mean_last"] - runs["sync"]["reward_mean_last"]
    data = {"runs": runs, "margin": MARGIN, "last_reward_gap": gap, "reaches_sync": bool(abs(gap) <= MARGIN),
            "machine": machine()}
    write_result(OUT, data)
    plot(data)
    print(f"-> {OUT}, {PNG}")
    for name, r in runs.items():
        print(f"{name}: reward {r['reward_mean_first']:.3f} -> {r['reward_mean_last']:.3f}, wall {r['wall_s']:.0f} s")
    print(f"k2 - sync (last 20%): {gap:+.3f}; within {MARGIN}: {data['reaches_sync']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
