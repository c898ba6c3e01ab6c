"""Does tail batching cost accuracy? The quickstart with and without it, reward gain at equal wall time.

    python scripts/bench_tail_learning.py --out scripts/results/bench_tail_learning.json   # + .png
    python scripts/bench_tail_learning.py --out /tmp/l.json --steps 4 --extra warm_start.steps=3  # smoke

Runs `python -m jaxrl.train` twice from the same seed, one after the other (so they never share the CPU):
the quickstart recipe as it is, and with `rollout.tail_batching.enabled=true`. Each run's metrics give
reward_mean against cumulative wall time (the sum of step_seconds; warm start and compilation excluded for
both). The reward gain is the mean reward of the last 10% of the steps each run completes within the
synchronous run's total RL time, minus the mean of its first 5 steps. The issue's bar: tail batching's gain
within the same wall time is >= 0.2 (it must not cost accuracy).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_harness import write_result  # noqa: E402

OUTPUTS = ("bench_tail_learning.json", "bench_tail_learning.png")  # its files in scripts/results/ (tests/test_docs.py)


def run(run_dir: Path, extra: list[str]) -> list[dict]:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "jaxrl.train", f"run_dir={run_dir}", "save_every=null", "export_hf=false", *extra]
    print("+", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def gain_within(rows: list[dict], seconds: float) -> dict:
    t = np.cumsum([r["step_seconds"] for r in rows])
    inside = [r for r, ti in zip(rows, t) if ti <= seconds * 1.0001]
    rewards = np.asarray([r["reward_mean"] for r in inside])
    tail = max(1, len(rewards) // 10)
    return {"steps": len(inside), "seconds": float(t[len(inside) - 1]) if inside else 0.0,
            "start_reward": float(rewards[:5].mean()), "end_reward": float(rewards[-tail:].mean()),
            "gain": float(rewards[-tail:].mean() - rewards[:5].mean())}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "bench_tail_learning.json"))
    ap.add_argument("--steps", type=int, default=None, help="RL steps of each run (default: the recipe's)")
    ap.add_argument("--extra", nargs="*", default=[], help="more key=value overrides for both runs")
    args = ap.parse_args(argv)
    extra = ([f"steps={args.steps}"] if args.steps else []) + list(args.extra)
    with tempfile.TemporaryDirectory() as tmp:
        sync = run(Path(tmp) / "sync", extra)
        tail = run(Path(tmp) / "tail", extra + ["rollout.tail_batching.enabled=true"])
    budget = float(np.sum([r["step_seconds"] for r in sync]))
    out = {"overrides": extra, "sync_rl_seconds": budget,
           "sync": gain_within(sync, budget), "tail_batching": gain_within(tail, budget),
           "tail_rollout_s_mean": float(np.mean([r["rollout_s"] for r in tail])),
           "sync_rollout_s_mean": float(np.mean([r["rollout_s"] for r in sync])),
           "long_rounds": int(sum(r.get("tail/long_round", 0) for r in tail)),
           "curves": {"sync": [[r["step_seconds"], r["reward_mean"]] for r in sync],
                      "tail_batching": [[r["step_seconds"], r["reward_mean"]] for r in tail]}}
    path = write_result(args.out, out)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        for name, color in (("sync", "tab:gray"), ("tail_batching", "tab:blue")):
            c = np.asarray(out["curves"][name])
            ax.plot(np.cumsum(c[:, 0]), c[:, 1], color=color, label=name)
        ax.axvline(budget, color="k", lw=0.5, ls=":")
        ax.set_xlabel("RL wall time (s)")
        ax.set_ylabel("reward_mean")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path.with_suffix(".png"), dpi=110)
    except ImportError:
        pass
    print(json.dumps({k: out[k] for k in ("sync", "tail_batching", "long_rounds")}, indent=1))
    return out


if __name__ == "__main__":
    main()
