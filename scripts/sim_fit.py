"""The simulator's fitted constants and its held-out validation, as JSON (`docs/simulator.md` renders it).

    python scripts/sim_fit.py --out scripts/results/sim_fit.json        # seconds; no simulation is re-run

`fitted`: each constant of the cost model that is fitted (`jaxrl/sim/fit.py`), the value its fit computes
from the named published points, the value in use and the points used. These reproduce what they were
fitted to by construction: they are tests of the fit, not validation.
`held_out`: published points that no fit uses (`jaxrl/sim/heldout.py`), the simulator's prediction (the cost
model live, or the committed runs in `scripts/results/bench_sim_cluster.json`), the relative error and a
verdict. `tests/test_sim_fit.py` checks that this file equals what the code computes now.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_harness import write_result  # noqa: E402
from jaxrl.runtime import request_cpu_devices  # noqa: E402

CLUSTER = "scripts/results/bench_sim_cluster.json"
OUTPUTS = ("sim_fit.json",)  # its files in scripts/results/ (tests/test_docs.py)


def results(cluster: dict) -> dict:
    """The JSON body (no machine): what `tests/test_sim_fit.py` recomputes."""
    from jaxrl.sim.fit import POINTS, STALE, TOLERANCE, fit_all, fit_inputs
    from jaxrl.sim.heldout import held_out

    fits = fit_all(cluster)
    fitted = [{"constant": f.name, "value": float(f.value), "in_use": f.in_use, "where": f.where,
               "in_use_vs_fit": float(f.rel_diff),
               "tolerance": f"stale: in use {STALE[f.name]:+.1%} from the fit" if f.name in STALE
               else f"in use within {TOLERANCE:.1%} of the fit",
               "points": [dataclasses.asdict(POINTS[p]) for p in f.points]} for f in fits]
    return {"fitted": fitted, "held_out": held_out(cluster), "fit_inputs": sorted(fit_inputs(fits)),
            "simulated_inputs": CLUSTER}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "scripts/results/sim_fit.json"))
    args = ap.parse_args(argv)
    request_cpu_devices(8)            # the reshard bytes are counted by `sharding.reuse` over one node's devices
    from jaxrl.train.summary import machine

    body = results(json.loads((ROOT / CLUSTER).read_text()))
    body["machine"] = {**machine(), "note": "computed from the code and the committed simulator runs; "
                                            "no timing depends on this machine"}
    write_result(args.out, body)
    for f in body["fitted"]:
        print(f"[fit] {f['constant']:>20} = {f['value']:.4g} (in use {f['in_use']:.4g}, {f['in_use_vs_fit']:+.1%})",
              file=sys.stderr)
    for h in body["held_out"]:
        print(f"[held out] {h['point']:>28}: {h['published']:.4g} published, {h['simulated']:.4g} simulated "
              f"({h['rel_error']:+.1%}): {h['verdict']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
