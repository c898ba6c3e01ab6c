"""The all-mechanisms recipes at quickstart size: do they learn the quickstart task, and did every mechanism act?

    scripts/venv.sh python scripts/bench_recipes.py                       # both recipes, one after the other
    scripts/venv.sh python scripts/bench_recipes.py all_mechanisms_async  # one of them
    scripts/venv.sh python scripts/bench_recipes.py --from all_mechanisms=runs/recipe_all_mechanisms   # no run
    scripts/venv.sh python scripts/docs.py                                # then re-render docs/composition.md

Each recipe (configs/<name>.yaml, written from `jaxrl.config.composition.RECIPES`) runs as its header says:
`all_mechanisms` on 2 processes (`scripts/launch_local.sh 2`), `all_mechanisms_async` in one, into
runs/recipe_<name> (the script stops if that directory exists: the trainer would resume it). From each run
directory it reads the summary the run wrote (`jaxrl/train/summary.py`: wall time, rewards over the first and
last 20% of the RL steps) and, from metrics.jsonl, what shows that each mechanism acted: tail batching's
launched and trained prompts and long rounds, dynamic sampling's dropped groups and waves, skew placement's
active steps, the planner's TP changes, the blockwise backward's blocks, the repartition's moved bytes,
one-step-async's staleness. It writes scripts/results/bench_recipes.json with the quickstart's own rewards
(scripts/results/quickstart.json) beside them: "learns" is the recipe's mean reward over its last 20% of
steps minus its first 20%, set against the quickstart's rise over the same windows. A run's wall time is
only meaningful on an otherwise idle machine.
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
OUT = RESULTS / "bench_recipes.json"
OUTPUTS = ("bench_recipes.json",)   # its files in scripts/results/ (tests/test_docs.py)
RECIPES = {"all_mechanisms": 2, "all_mechanisms_async": 1}        # name -> processes


def command(name: str, run_dir: Path) -> list[str]:
    train = ["python", "-m", "jaxrl.train", "--config", f"configs/{name}.yaml", f"run_dir={run_dir}"]
    n = RECIPES[name]
    return [str(ROOT / "scripts" / "launch_local.sh"), str(n), *train] if n > 1 else \
        [str(ROOT / "scripts" / "venv.sh"), *train]


def run(name: str) -> Path:
    run_dir = ROOT / "runs" / f"recipe_{name}"
    if run_dir.exists():
        raise SystemExit(f"{run_dir} exists (the trainer would resume it): remove it, or pass --from {name}={run_dir}")
    cmd = command(name, run_dir)
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT)
    if p.returncode:
        raise SystemExit(f"{name}: exit status {p.returncode}")
    print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    return run_dir


def _values(rows: list[dict], key: str) -> list:
    return [r[key] for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]


def evidence(rows: list[dict]) -> dict:
    """What each mechanism did over the run, from its per-step metrics (absent keys: the mechanism is off)."""
    out = {}
    total = lambda k: float(np.sum(_values(rows, k))) if _values(rows, k) else None        # noqa: E731
    out["tail_batching"] = {"prompts_launched": total("tail/prompts_launched"),
                            "prompts_trained": total("tail/prompts_trained"),
                            "long_rounds": total("tail/long_round"),
                            "aborted_responses": total("tail/aborted_responses")}
    out["dynamic_sampling"] = {"dropped_groups": total("tail/dropped_groups"),
                               "steps_with_refill_waves": int(sum(w > 1 for w in _values(rows, "tail/waves")))}
    out["skew"] = {"active_steps": total("skew/active"), "long_prompts": total("skew/long_prompts")}
    tps = _values(rows, "planner/tp")
    out["planner"] = {"tp_changes": int(sum(a != b for a, b in zip(tps, tps[1:]))),
                      "tps_used": sorted({int(t) for t in tps})}
    out["blockwise"] = {"blocks": total("blockwise/blocks"), "skipped_blocks": total("blockwise/skipped")}
    out["repartition"] = {"bytes_moved": total("flow/bytes_moved"),
                          "padding_local": total("flow/padding_local"),
                          "padding_balanced": total("flow/padding_balanced")}
    stale = _values(rows, "placement/staleness")
    out["async"] = {"staleness": sorted({int(s) for s in stale})} if stale else None
    return out


def measure(name: str, run_dir: Path, quickstart: dict) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rise = summary["reward_mean_last"] - summary["reward_mean_first"]
    q_rise = quickstart["reward_mean_last"] - quickstart["reward_mean_first"]
    return {"config": f"configs/{name}.yaml", "processes": RECIPES[name], "command": " ".join(command(name, Path(
        f"runs/recipe_{name}"))).replace(str(ROOT) + "/", ""), "summary": summary,
        "reward_rise": rise, "quickstart_reward_rise": q_rise, "rise_vs_quickstart": rise / q_rise if q_rise else None,
        "learns": bool(rise > 0), "mechanisms": evidence(rows)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*", help=f"recipes to run, of {list(RECIPES)} (default: both)")
    ap.add_argument("--from", dest="sources", action="append", default=[], metavar="NAME=RUN_DIR",
                    help="take a finished run directory instead of running NAME")
    args = ap.parse_args(argv)
    sources = dict(s.split("=", 1) for s in args.sources)
    bad = [n for n in [*args.names, *sources] if n not in RECIPES]
    if bad:
        raise SystemExit(f"unknown recipe(s) {bad}; known: {list(RECIPES)}")
    names = args.names or ([] if sources else list(RECIPES))
    quickstart = json.loads((RESULTS / "quickstart.json").read_text())
    old = json.loads(OUT.read_text()) if OUT.exists() else {}
    recipes = dict(old.get("recipes", {}))
    for name in dict.fromkeys([*names, *sources]):
        run_dir = Path(sources[name]) if name in sources else run(name)
        recipes[name] = measure(name, run_dir, quickstart)
    data = {"quickstart": {k: quickstart[k] for k in ("reward_mean_first", "reward_mean_last", "steps", "wall_s")},
            "recipes": recipes,
            "machine": machine()}
    write_result(OUT, data)
    print(f"-> {OUT}")
    for name, r in recipes.items():
        s = r["summary"]
        print(f"{name}: reward {s['reward_mean_first']:.3f} -> {s['reward_mean_last']:.3f} ({r['reward_rise']:+.3f}; "
              f"quickstart {r['quickstart_reward_rise']:+.3f}), wall {s['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
