"""StreamRL's stage balancing (paper §4.2): split the devices so that neither stage waits, and scale the
generation pool up during training when it falls behind.

    x, y, table = best_split(total=8, gen_unit=1, train_sizes=[1, 2, 4], t_gen=tg, t_train=tt)
    scale = ScaleUp(section, tp)             # stage_balance.scale_up
    metrics = scale.step(svc, t_gen, t_train, params)   # after each step: maybe one more instance

**Static split.** (x, y) = argmin over x + y <= total (x a multiple of the generation instance's devices,
y a size the train layout can take) of max(T_g(x), T_t(y)), from stage-time functions the caller
measured or modelled (`scaled`: a stage time measured on n devices, scaled as work / devices). Ties go
to fewer devices in all, then to more generation devices. `searched_split`: the same answer from
O(log n) evaluations of T_g, for a T_g that is costly to evaluate (the simulator's `split=simulated` runs
the rollout on x GPUs for each: StreamRL's generation time as a function of the resources, which a
long-tailed rollout does not follow as work / devices).

**Dynamic scale-up.** Generation lengths grow during RL (the paper's Figure 2), so T_g grows faster
than T_t and δ = T_g − T_t widens. After each step, with k instances, adding one is predicted to save
δ' = T_g − T_g·k/(k+1) = T_g/(k+1) (the prompts split over one more data-parallel instance); when
δ >= δ' and a spare device group is left (`stage_balance.max_instances`), the generation pool grows by
one instance at the weight sync (a relayout between steps: nothing is live, only the new instance's
weights move, and its step set was compiled at warm-up). At most one scale-up per `min_steps` steps.

Simplified: T_g/(k+1) assumes generation time scales with the instance count, which the long tail
bends (the slowest sequence does not get faster); the paper estimates δ' from its performance model.

**Several processes** (each with a generation pool of its own beside the shared train mesh): one decision
for all. T_g and T_t are the largest over the processes (a step waits for the slowest rollout), so every
process grows its pool at the same step, by one instance of its own.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from jaxrl.config.loading import from_yaml_file
from jaxrl.config.train import TrainConfig

from .distributed import allgather


def scaled(seconds: float, devices: int) -> Callable[[int], float]:
    """A stage time measured on `devices` devices, modelled as perfectly parallel: T(n) = seconds·devices/n."""
    return lambda n: seconds * devices / n


def best_split(total: int, gen_unit: int, train_sizes: Sequence[int], t_gen: Callable[[int], float],
               t_train: Callable[[int], float]) -> tuple[int, int, list[tuple[int, int, float]]]:
    """(x generation devices, y train devices, [(x, y, max(T_g, T_t)) for every feasible split])."""
    table = []
    for y in sorted(set(train_sizes)):
        for x in range(gen_unit, total - y + 1, gen_unit):
            table.append((x, y, max(float(t_gen(x)), float(t_train(y)))))
    if not table:
        raise ValueError(f"no split of {total} devices into generation groups of {gen_unit} and a train "
                         f"layout of {sorted(set(train_sizes))}")
    x, y, _ = min(table, key=lambda r: (round(r[2], 12), r[0] + r[1], -r[0]))
    return x, y, table


def searched_split(total: int, gen_unit: int, train_sizes: Sequence[int], t_gen: Callable[[int], float],
                   t_train: Callable[[int], float]) -> tuple[int, int, list[tuple[int, int, float]], dict[int, float]]:
    """`best_split`'s answer where T_g(x) is costly to evaluate (StreamRL's generation time modelled by running
    the rollout on x devices, as the simulator does), evaluating it at O(log(total / gen_unit)) points, not at
    every x. Needs T_g nonincreasing in x (more devices never slow the rollout) and T_t decreasing in y.

    With y(x) the largest train size that fits beside x, max(T_g(x), T_t(y(x))) is smallest where the two
    curves cross: a binary search finds the first x with T_g(x) <= T_t(y(x)); the best value V is the better of
    it and the x before it. A second search finds the fewest generation devices with T_g <= V. `best_split`
    then decides over the evaluated points (T_g = inf elsewhere): its answer and tie-breaks are those of the
    full enumeration (tests/test_pipeline.py checks it on random monotone curves). Returns (x, y, the table's
    evaluated rows, {x: T_g(x)} evaluated)."""
    sizes = sorted(set(train_sizes))
    xs = list(range(gen_unit, total - sizes[0] + 1, gen_unit)) if sizes else []
    if not xs:
        raise ValueError(f"no split of {total} devices into generation groups of {gen_unit} and a train "
                         f"layout of {sizes}")
    seen: dict[int, float] = {}

    def g(i: int) -> float:
        if xs[i] not in seen:
            seen[xs[i]] = float(t_gen(xs[i]))
        return seen[xs[i]]

    def tt(i: int) -> float:              # T_t on the largest train size beside xs[i]
        return float(t_train(max(s for s in sizes if s <= total - xs[i])))

    lo, hi = 0, len(xs)                   # the first i with T_g <= T_t(y(x)), len(xs) if none
    while lo < hi:
        mid = (lo + hi) // 2
        if g(mid) <= tt(mid):
            hi = mid
        else:
            lo = mid + 1
    near = [i for i in (lo - 1, lo) if 0 <= i < len(xs)]
    best = min(max(g(i), tt(i)) for i in near)
    lo, hi = 0, max(near)                 # the fewest generation devices with T_g <= best
    while lo < hi:
        mid = (lo + hi) // 2
        if g(mid) <= best:
            hi = mid
        else:
            lo = mid + 1
    g(lo)
    x, y, table = best_split(total, gen_unit, sizes, lambda n: seen.get(n, math.inf), t_train)
    return x, y, [r for r in table if math.isfinite(r[2])], dict(sorted(seen.items()))


def scale_up_due(t_gen: float, t_train: float, instances: int) -> tuple[bool, float, float]:
    """(due, δ, δ'): δ = T_g − T_t, δ' = T_g / (instances + 1); due when δ >= δ' > 0."""
    delta, gain = t_gen - t_train, t_gen / (instances + 1)
    return delta >= gain > 0, delta, gain


class ScaleUp:
    """The dynamic scale-up of a running disaggregated trainer (`stage_balance`)."""

    def __init__(self, section, tp: int):
        self.section, self.tp = section, tp
        self.since = section.min_steps          # steps since the last scale-up
        self.scaled = 0

    def step(self, svc, t_gen: float, t_train: float, params, *, warm=None, grow=None,
             instances: int | None = None) -> dict:
        """After a step: decide, and grow `svc` by one instance when due (its weights from `params`): by
        `grow(instances)` when given (the trainer's: `RolloutSide.grow`, the owner of the layout), else by a
        relayout of `svc` here. `instances`: the pool's size in instances of `tp` devices (default: the
        service's instances; the rollout side's count when the planner may run another TP)."""
        k = len(svc.instances) if instances is None else instances
        t_gen, t_train = (float(t) for t in allgather([t_gen, t_train], tag="scale_up").max(axis=0))
        due, delta, gain = scale_up_due(t_gen, t_train, k)
        self.since += 1
        room = k < self.section.max_instances and (k + 1) * self.tp <= len(svc.devices)
        grew = 0
        if due and room and self.since >= self.section.min_steps:
            if grow is not None:
                grow(k + 1)
            else:
                svc.relayout(self.tp, k + 1, weights=params)
            if warm is not None:
                svc.warm(warm)
            self.since, self.scaled, grew = 0, self.scaled + 1, 1
        return {"placement/t_gen_s": t_gen, "placement/t_train_s": t_train, "placement/delta_s": delta,
                "placement/delta_prime_s": gain, "placement/scaled_up": grew}


def split_from_run(run_dir, total: int) -> dict:
    """The static split for `total` devices from a disaggregated run's measured stage times (the median over
    its steps after the first): T_g from rollout seconds on its generation devices, T_t from the train
    pool's busy seconds (train_s when absent) on its train devices, each scaled as work / devices. Train
    sizes are the powers of two; generation devices come in groups of the run's engine.tp."""
    run = Path(run_dir)
    cfg = from_yaml_file(TrainConfig, run / "config.yaml")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "placement/gen_devices" in r][1:] or rows[-1:]
    if not rows or "placement/gen_devices" not in rows[0]:
        raise ValueError(f"{run}: no placement/... metrics (run it with placement=disaggregated)")
    gen_devices, train_devices = rows[-1]["placement/gen_devices"], rows[-1]["placement/train_devices"]
    t_gen = float(np.median([r["rollout_s"] for r in rows]))
    t_train = float(np.median([r.get("placement/t_train_s", r["train_s"]) for r in rows]))
    sizes = [2 ** k for k in range(total.bit_length()) if 2 ** k < total]
    x, y, table = best_split(total, cfg.engine.tp, sizes, scaled(t_gen, gen_devices), scaled(t_train, train_devices))
    return {"gen_devices": x, "train_devices": y, "engine.instances": x // cfg.engine.tp,
            "predicted_s": max(t_gen * gen_devices / x, t_train * train_devices / y),
            "measured": {"t_gen_s": t_gen, "t_train_s": t_train, "gen_devices": gen_devices,
                         "train_devices": train_devices},
            "table": [{"gen_devices": a, "train_devices": b, "predicted_s": t} for a, b, t in table]}


def main(argv=None) -> int:
    """`python -m jaxrl.train.balance RUN_DIR DEVICES`: the split a disaggregated run's stage times suggest."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or not args[1].isdigit():
        print("usage: python -m jaxrl.train.balance RUN_DIR DEVICES", file=sys.stderr)
        return 2
    got = split_from_run(args[0], int(args[1]))
    print(json.dumps({k: v for k, v in got.items() if k != "table"}, indent=1))
    print(f"-> placement=disaggregated engine.instances={got['engine.instances']} (x tp) with a train layout of "
          f"{got['train_devices']} devices", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
