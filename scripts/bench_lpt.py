"""LPT vs FCFS admission inside one rollout instance that holds more prompts than its batch cap
(StreamRL §5.3, "scheduling order"), real decode work on the CPU, side by side in one run.

    python scripts/bench_lpt.py --out scripts/results/bench_lpt.json     # + .png
    python scripts/bench_lpt.py --out /tmp/l.json --quick                 # smoke sizes

One instance (TP1) runs `--sequences` single-sample requests with a batch cap of `--cap`. Each request's
response length L is drawn from a clipped log-normal (median `--median`, sigma `--sigma`) and enforced
with max_new_tokens = L and no stop token, so the long tail is real decode work. Requests arrive in a
random order. Three admissions run the same requests on the same warmed engine, interleaved over
`--repeats` rounds (fcfs, lpt-oracle, lpt-predicted, fcfs, ...):
  * fcfs          — the engine's default: arrival order;
  * lpt_oracle    — longest first by the true length (what a perfect ranker gives);
  * lpt_predicted — longest first by a noisy prediction, L·exp(σ_p·z) with σ_p = `--noise` (a ranker of
                    imperfect accuracy; Kendall τ of the prediction is reported).
Reported per admission: decode (engine) steps, wall seconds (median over repeats), and the list-schedule
makespan of `skew.lpt_makespan` / `fcfs_makespan` (what the scheduler should run: they must agree, the
engine adds one step per prefill wave). Ratios are fcfs / lpt. Model: bench_rollout's hidden-512, 8-layer
Qwen3 shape (random weights, float32); tiny with --quick.
"""

from __future__ import annotations

import argparse
import functools
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import numpy as np  # noqa: E402

from bench_harness import interleaved, write_result  # noqa: E402

ORDERS = ("fcfs", "lpt_oracle", "lpt_predicted")

OUTPUTS = ("bench_lpt.json", "bench_lpt.png")  # its files in scripts/results/ (tests/test_docs.py)


def run(args) -> dict:
    import jax

    from bench_rollout import bench_config
    from jaxrl.rollout import RolloutService, SamplingParams
    from jaxrl.rollout.ranker import kendall_tau
    from jaxrl.rollout.skew import fcfs_makespan, lpt_makespan
    from models import init

    cfg = bench_config(args.quick)
    weights = init(jax.random.key(0), cfg)
    rng = np.random.default_rng(args.seed)
    lengths = np.clip(np.round(args.median * np.exp(args.sigma * rng.standard_normal(args.sequences))), 1,
                      args.max_len).astype(int).tolist()
    prompts = [rng.integers(10, cfg.vocab_size, size=int(rng.integers(8, 17))).tolist() for _ in lengths]
    predicted = (np.asarray(lengths) * np.exp(args.noise * rng.standard_normal(len(lengths)))).tolist()
    page = 16
    per_seq = -(-(16 + args.max_len) // page)
    svcs = {}
    for order in ("fcfs", "lpt"):
        svc = RolloutService(cfg, weights, page_size=page, max_batch=args.cap, max_seq_len=16 + args.max_len,
                             num_pages=args.cap * per_seq + 1, order=order)
        svc.warm([SamplingParams(max_new_tokens=args.max_len, temperature=1.0)])
        svcs[order] = svc

    def admit(order: str) -> tuple:
        """(untimed) Every request queued on the order's service; its priorities are the order's."""
        svc = svcs["fcfs" if order == "fcfs" else "lpt"]
        prio = {"fcfs": [0.0] * len(lengths), "lpt_oracle": [float(n) for n in lengths],
                "lpt_predicted": predicted}[order]
        for k, (p, n, q) in enumerate(zip(prompts, lengths, prio)):
            svc.add(p, SamplingParams(max_new_tokens=n, temperature=1.0, seed=k), priority=q)
        return (svc,)

    def drain(svc) -> int:
        """(timed) Engine steps until every request finished."""
        steps, got = 0, 0
        while svc.has_work():
            got += len(svc.step())
            steps += 1
        assert got == len(lengths)
        return steps

    runs = interleaved({o: drain for o in ORDERS}, args.repeats,
                       prepare={o: functools.partial(admit, o) for o in ORDERS},
                       on_call=lambda o, r, s, steps: print(f"[{o}] repeat {r}: {steps} engine steps, {s:.2f} s",
                                                            flush=True))
    order_pred = sorted(range(len(lengths)), key=lambda i: (-predicted[i], i))
    model = {"fcfs": fcfs_makespan(lengths, args.cap), "lpt_oracle": lpt_makespan(lengths, args.cap),
             "lpt_predicted": fcfs_makespan([lengths[i] for i in order_pred], args.cap)}
    out = {"model": "quick" if args.quick else "hidden-512 x 8 layers (58M, qwen3 shape)",
           "sequences": args.sequences, "cap": args.cap, "median": args.median, "sigma": args.sigma,
           "max_len": args.max_len, "noise": args.noise, "repeats": args.repeats, "seed": args.seed,
           "lengths": lengths, "p99_over_median": float(np.percentile(lengths, 99) / np.median(lengths)),
           "prediction_kendall_tau": float(kendall_tau(predicted, lengths)), "machine": platform.processor() or
           platform.machine(), "jax": jax.__version__, "orders": {}}
    for o in ORDERS:
        secs = runs.seconds[o]
        out["orders"][o] = {"engine_steps": runs.results[o][0], "list_schedule_steps": model[o],
                            "seconds_median": float(np.median(secs)), "seconds": secs}
    f = out["orders"]
    for o in ("lpt_oracle", "lpt_predicted"):
        out[f"step_ratio_{o}"] = f["fcfs"]["engine_steps"] / f[o]["engine_steps"]
        out[f"speedup_{o}"] = f["fcfs"]["seconds_median"] / f[o]["seconds_median"]
    return out


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(9, 3.4))
    names = list(out["orders"])
    ax[0].bar(names, [out["orders"][o]["engine_steps"] for o in names], color=["tab:gray", "tab:blue", "tab:cyan"])
    ax[0].set_ylabel("decode steps (engine)")
    ax[1].bar(names, [out["orders"][o]["seconds_median"] for o in names], color=["tab:gray", "tab:blue", "tab:cyan"])
    ax[1].set_ylabel("seconds (median)")
    fig.suptitle(f"{out['sequences']} requests, batch cap {out['cap']} (one instance, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "bench_lpt.json"))
    ap.add_argument("--quick", action="store_true", help="tiny model and sizes (a smoke test)")
    ap.add_argument("--sequences", type=int, default=None)
    ap.add_argument("--cap", type=int, default=None, help="the instance's batch cap")
    ap.add_argument("--median", type=float, default=None)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--max-len", type=int, default=None)
    ap.add_argument("--noise", type=float, default=0.5, help="log-normal sigma of the predicted lengths")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    q = args.quick
    args.sequences = args.sequences or (12 if q else 64)
    args.cap = args.cap or (4 if q else 16)
    args.median = args.median or (4 if q else 16)
    args.max_len = args.max_len or (32 if q else 256)
    args.repeats = args.repeats or (1 if q else 3)
    out = run(args)
    path = write_result(args.out, out)
    plot(out, path.with_suffix(".png"))
    print(f"LPT (oracle) {out['step_ratio_lpt_oracle']:.2f}x fewer decode steps, {out['speedup_lpt_oracle']:.2f}x "
          f"wall; predicted (tau {out['prediction_kendall_tau']:.2f}) {out['step_ratio_lpt_predicted']:.2f}x / "
          f"{out['speedup_lpt_predicted']:.2f}x; wrote {path}")
    return out


if __name__ == "__main__":
    main()
