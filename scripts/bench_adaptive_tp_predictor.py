"""PAT's predictor accuracy on this CPU: one fresh profile and real long-tail trajectories (bench_adaptive_tp's
functions), MAPE under the paper's context measure and under the padded shape, and the machine's own noise.

    scripts/venv.sh python scripts/bench_adaptive_tp_predictor.py      # -> scripts/results/ (same name, .json)
    scripts/venv.sh python scripts/bench_adaptive_tp_predictor.py --out /tmp/p.json

Per TP, on one service: the profiler's `measure_layout` over `shape_grid` (every rows bucket x one context
inside each page-table width of the XLA decode shapes; a point is the median of 12 back-to-back steps) and one
long-tail greedy generation on the first TP group (its first 60 decode steps, each timed from the end of the
one before), alternated 6 times each; each profile point is the median of its 6 passes, each trajectory step
the median of its 6 runs. `noise`: for each run, the mean |run − median of the other runs|
/ median of the others, averaged over the runs: how far one timing of a step strays on this host.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import bench_adaptive_tp as B  # noqa: E402
from bench_harness import write_result  # noqa: E402
from jaxrl.config.generate import EngineSection  # noqa: E402
from jaxrl.rollout.adaptive_tp import Predictor, Profile  # noqa: E402
from jaxrl.rollout.profile import measure_layout, shape_grid  # noqa: E402
from jaxrl.rollout.service import RolloutService  # noqa: E402
from models import init  # noqa: E402

REPEATS, STEPS, PASSES, DECODE_STEPS = 6, 60, 6, 12
DEFAULT_OUT = ROOT / "scripts" / "results" / "bench_adaptive_tp_predictor.json"
OUTPUTS = ("bench_adaptive_tp_predictor.json",)      # what it writes into scripts/results/ (tests/test_docs.py)


def main(argv: list[str] | None = None) -> dict:
    from jaxrl.runtime import request_cpu_devices

    request_cpu_devices(8)          # 8 fake CPU devices (before anything starts JAX's backend)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON file to write (default %(default)s)")
    args = ap.parse_args(argv)
    cfg = B.model_config(False)
    w = init(jax.random.key(0), cfg)
    engine = EngineSection(tp=2, instances=4, max_batch=16, max_seq_len=512, page_size=16, overlap=False)
    t0 = time.time()
    total = 64
    runs, layouts, rng = {}, {}, np.random.default_rng(0)
    for tp in (1, 2, 4):
        svc = RolloutService.from_config(
            dataclasses.replace(engine, tp=tp, instances=8 // tp, max_batch=total * tp // 8), cfg, w)
        batches, contexts = shape_grid(svc.instances[0].shapes, DECODE_STEPS)
        prompts, lens = B.requests(min(total * tp // 8, 32), tp, cfg.vocab_size, 40, 300)
        # profile passes and trajectory runs alternate on one service, so a drift of the host's speed over
        # minutes reaches both alike (a profile taken minutes before its trajectories measured a different machine)
        passes, runs[tp] = [], []
        for k in range(max(REPEATS, PASSES)):
            if k < PASSES:
                passes.append(measure_layout(svc, tp, batches, contexts, DECODE_STEPS, cfg.vocab_size, rng,
                                             contention=False))
            if k < REPEATS:
                runs[tp].append(B.trajectory(svc, prompts, lens, STEPS))
        if any([r[:2] + r[3:] for r in run] != [r[:2] + r[3:] for r in runs[tp][0]] for run in runs[tp]):
            raise RuntimeError("repeated trajectories differ in batch or context: not the same generation")
        lp = passes[0]
        lp.decode = [(b, n, float(np.median([p.decode[i][2] for p in passes])))
                     for i, (b, n, _) in enumerate(lp.decode)]
        lp.prefill = [(b, n, float(np.median([p.prefill[i][2] for p in passes])))
                      for i, (b, n, _) in enumerate(lp.prefill)]
        layouts[tp] = lp
        del svc
        B.free_executables()
        print("layout", tp, round(time.time() - t0), "s", flush=True)
    prof = Profile({"what": "bench_adaptive_tp_predictor"}, layouts, 0.0, {}, cfg.num_layers, 0)
    padded = Predictor(prof)
    plain_prof = Profile.from_json(prof.to_json())
    for lp in plain_prof.layouts.values():
        lp.shapes = None
    plain = Predictor(plain_prof)
    out = {"what": "predictor accuracy, one fresh profile (grid of the padded shapes, 6 passes) and the same "
                   "trajectories under two context measures, and the host's timing noise",
           "how": __doc__.strip(), "repeats": REPEATS, "steps": STEPS,
           "predictor_mape_padded": {}, "predictor_mape_sum": {}, "noise": {}, "trajectories": {},
           "profile": prof.to_json()}
    for tp, rs in runs.items():
        times = np.asarray([[s[2] for s in r] for r in rs])
        med = np.median(times, axis=0)
        rows = [(b, t, float(m), lm) for (b, t, _, lm), m in zip(rs[0], med)]
        others = [np.median(np.delete(times, i, 0), axis=0) for i in range(len(rs))]
        noise = np.mean([np.mean(np.abs(times[i] - o) / o) for i, o in enumerate(others)])
        out["noise"][str(tp)] = round(float(noise), 4)
        out["predictor_mape_padded"][str(tp)] = round(B.mape(padded, rows, tp), 4)
        out["predictor_mape_sum"][str(tp)] = round(B.mape(plain, rows, tp), 4)
        out["trajectories"][str(tp)] = rows
        print(tp, "padded", out["predictor_mape_padded"][str(tp)], "sum", out["predictor_mape_sum"][str(tp)],
              "noise", out["noise"][str(tp)], flush=True)
    write_result(args.out, out)
    return out


if __name__ == "__main__":
    main()
