"""Code-reward wall time per step: adaptive vs fixed per-test-case timeouts (RollPacker §4.3, Fig. 13c).

    python scripts/bench_code_rewards.py            # -> scripts/results/bench_code_rewards.json (~5 minutes)
    python scripts/bench_code_rewards.py --quick --out /tmp/code.json

Each simulated step scores a batch of code responses through one `RewardScheduler` per mode over a
shared `RewardPool`: `--problems` prompts of the built-in `code` task (the same prompts every step, as
in later epochs) × `--samples` responses each (64 by default). Per step, `--hangs` responses never
terminate (`while True: time.sleep(1)`: they sleep rather than spin, so they do not steal the shared
CPU from the other runs; a spinning one would end at the same timeout), `--wrong` print a wrong answer,
the rest are the correct reference programs. All responses of a step are submitted at once and the
step's wall time is submit → every reward back (`drain`), i.e. the reward stage with nothing hidden
under the rollout.

Modes: `fixed` gives every test case T_max (the paper's baseline, 30 s); `adaptive` gives
min(max(T_min, λ·T_anchor), T_max) with anchors from the correct runs of earlier steps (λ = 1.5,
T_min = 2 s). The modes alternate within each step (fixed first on even steps), so load drifts hit both.
In step 1 no case has an anchor yet (the batch is submitted at once), so adaptive = fixed there: the
summary reports that cold step apart from the warm ones. A program that times out on one case is not
run on the others (`jaxrl.rewards.code`), in both modes.

Reading it: `summary.<mode>.warm_mean_wall_s` and `summary.speedup_warm` (fixed / adaptive over the
warm steps); `correct_scored_1` per step must equal the number of correct responses in both modes
(the adaptive timeout never cut a correct program). On the CPU, compare the ratio; the absolute seconds
depend on this machine's load (`loadavg_before/after`) and the number of reward workers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_harness import write_result  # noqa: E402
from jaxrl.data.tasks import demonstration, make_suite  # noqa: E402
from jaxrl.rewards import AdaptiveTimeouts, RewardPool, RewardScheduler, SandboxLimits  # noqa: E402
from jaxrl.rewards.sandbox import isolation_report  # noqa: E402

HANG = "import time\nwhile True:\n    time.sleep(1)"
WRONG = "print(0)"
DEFAULT_OUT = ROOT / "scripts" / "results" / "bench_code_rewards.json"

OUTPUTS = ("bench_code_rewards.json",)  # its files in scripts/results/ (tests/test_docs.py)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--problems", type=int, default=16)
    p.add_argument("--samples", type=int, default=4, help="responses per problem (a group)")
    p.add_argument("--hangs", type=int, default=4, help="non-terminating responses per step")
    p.add_argument("--wrong", type=int, default=12, help="wrong-answer responses per step")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--workers", type=int, default=2, help="reward pool workers")
    p.add_argument("--t-max", type=float, default=30.0)
    p.add_argument("--t-min", type=float, default=2.0)
    p.add_argument("--lam", type=float, default=1.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny smoke run (tests)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.quick:
        args.problems, args.samples, args.hangs, args.wrong, args.steps = 2, 4, 1, 2, 2
        args.t_max, args.t_min = 1.5, 0.3
    if args.hangs + args.wrong > args.problems * args.samples:
        p.error("--hangs + --wrong exceed the batch")
    return args


def batch(problems, args, step: int) -> list[tuple[int, str, str]]:
    """[(problem index, kind, program)] for one step: the same in both modes."""
    rng = np.random.default_rng([args.seed, step])
    n = args.problems * args.samples
    kinds = np.array(["correct"] * n, dtype=object)
    picks = rng.permutation(n)
    kinds[picks[:args.hangs]] = "hang"
    kinds[picks[args.hangs:args.hangs + args.wrong]] = "wrong"
    out = []
    for k in range(n):
        p = k // args.samples
        program = {"correct": demonstration(problems[p]), "hang": HANG, "wrong": WRONG}[kinds[k]]
        out.append((p, str(kinds[k]), program))
    return out


def run_step(sched: RewardScheduler, problems, responses, args) -> dict:
    t0 = time.monotonic()
    for k, (p, kind, program) in enumerate(responses):
        sched.submit(k, ("code", program, problems[p].answer, "code"), group=p, group_size=args.samples)
    out = sched.drain()
    wall = time.monotonic() - t0
    assert sched.pending == 0 and len(out.groups) == args.problems, "every group completes"
    scores = {r.key: r.score for r in out.responses}
    m = sched.metrics()
    return dict(wall_s=round(wall, 3), groups=len(out.groups),
                correct_scored_1=sum(scores[k] == 1.0 for k, (_, kind, _) in enumerate(responses) if kind == "correct"),
                correct=sum(kind == "correct" for _, kind, _ in responses),
                case_timeouts=int(m.get("reward/case_timeouts", 0)), case_runs=int(m.get("reward/case_runs", 0)),
                timeout_mean_s=round(m.get("reward/adaptive_timeout_mean_s", 0.0), 3),
                saved_s=round(m.get("reward/saved_s", 0.0), 3), anchored_cases=int(m["reward/anchored_cases"]),
                pool_timeouts=int(m["reward/timeouts"]), crashes=int(m["reward/crashes"]))


def main(argv=None) -> dict:
    args = parse_args(argv)
    problems = make_suite(["code"], args.problems, args.seed)
    limits = SandboxLimits()
    result = dict(config={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                  machine=dict(cores=os.cpu_count(), loadavg_before=os.getloadavg(),
                               isolation=isolation_report(limits)),
                  steps=[])
    with RewardPool(num_workers=args.workers, timeout_s=60.0) as pool:
        scheds = {"fixed": RewardScheduler(pool, AdaptiveTimeouts(args.lam, args.t_min, args.t_max, enabled=False),
                                           limits=limits),
                  "adaptive": RewardScheduler(pool, AdaptiveTimeouts(args.lam, args.t_min, args.t_max),
                                              limits=limits)}
        for step in range(args.steps):
            responses = batch(problems, args, step)
            for mode in (["fixed", "adaptive"] if step % 2 == 0 else ["adaptive", "fixed"]):
                row = dict(step=step + 1, mode=mode, **run_step(scheds[mode], problems, responses, args))
                result["steps"].append(row)
                print(json.dumps(row), flush=True)
        result["anchors"] = scheds["adaptive"].state_dict()["timeouts"]["anchors"]
    result["machine"]["loadavg_after"] = os.getloadavg()
    summary = {}
    for mode in ("fixed", "adaptive"):
        rows = [r for r in result["steps"] if r["mode"] == mode]
        warm = [r["wall_s"] for r in rows if r["step"] > 1]
        summary[mode] = dict(mean_wall_s=round(statistics.mean(r["wall_s"] for r in rows), 3),
                             cold_wall_s=rows[0]["wall_s"],
                             warm_mean_wall_s=round(statistics.mean(warm), 3) if warm else None)
    summary["speedup_all"] = round(summary["fixed"]["mean_wall_s"] / summary["adaptive"]["mean_wall_s"], 2)
    if summary["adaptive"]["warm_mean_wall_s"]:
        summary["speedup_warm"] = round(summary["fixed"]["warm_mean_wall_s"]
                                        / summary["adaptive"]["warm_mean_wall_s"], 2)
    result["summary"] = summary
    write_result(args.out, result, indent=2)
    print(json.dumps(summary, indent=2))
    return result


if __name__ == "__main__":
    main()
