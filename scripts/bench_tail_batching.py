"""Tail batching (RollPacker §3) vs plain synchronous rollout on the CPU, side by side in one run.

    python scripts/bench_tail_batching.py --out scripts/results/bench_tail_batching.json   # + .png
    python scripts/bench_tail_batching.py --out /tmp/t.json --quick                          # smoke sizes

The task: every prompt sets its own response length L (drawn once per prompt from a clipped log-normal,
median `--median`, sigma `--sigma`; p99/median is reported and is >= 10 by default). The rollout model
(the hidden-512, 8-layer Qwen3-shaped model of bench_train/bench_rollout, random weights, float32)
samples at temperature 1 with no stop token and `max_new_tokens = L`, so a response is exactly as long as
its prompt says — the long tail is real decode work, not a sleep. (All responses of a prompt are equally
long, so response speculation has nothing to cut here and its extra 25% of sequences is pure overhead;
the engine test in tests/test_tail_batching.py covers it with varied lengths.)

The schedules roll out the same prompt stream with the same engine and weights (no training: the
measure is rollout time): tail batching draws ⌈1.25·P0⌉ prompts per short round and runs a long round
whenever its queue holds P0 prompts; `carry` is the same with slime's carried partial responses
(`rollout.tail_batching.carry_partial`: a deferred prompt's responses keep their tokens and the long round
continues them; no training, so no token is stale); the synchronous baseline draws P0 prompts per step, in
the same stream order. Steps alternate (tail step, carry step, sync step, ...) over whole periods (4 short +
1 long), so all see the same machine state; after the last period all have trained the same prompts. A
carried token counts as decoded in the round that decoded it, not as wasted, and not again when resumed (the
re-prefill of a resumed response's prompt + tokens is priced below as one decode row, which it is not quite). Reported per
schedule: rollout seconds per trained prompt, engine (decode) steps, decoded and wasted tokens; `speedup`
= sync seconds per trained prompt / tail batching's. The engine is warmed (every step shape compiled)
before anything is timed.

The saving is fewer sequential decode steps; whether they become saved seconds depends on how a step's
cost grows with its rows. `roofline` prices each schedule's recorded steps (every engine step's decode rows
and their contexts, `StepTrace`) with the simulator's `AnalyticCost.decode_s` — max(weight + KV bytes over
bandwidth, FLOPs over peak) — on two machines: this CPU at its measured float32 peak and read bandwidth
(`scripts/results/bench_peak.json`, every efficiency 1: no implementation of the step beats it), and the
simulator's H100 preset. On a machine whose step is bound by reading the weights up to large batches (a GPU)
the step ratio is what wall time follows; on one whose step turns compute-bound at ~10 rows (this CPU) the
extra decoded tokens of speculation cost as much as the saved steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import numpy as np  # noqa: E402

from bench_harness import write_result  # noqa: E402

OUTPUTS = ("bench_tail_batching.json", "bench_tail_batching.png")  # its files in scripts/results/ (tests/test_docs.py)


def zero_reward(response: str, answer: str, task: str) -> float:
    """The bench measures rollout time only; rewards are scored (and streamed) but constant."""
    return 0.0


class StepTrace:
    """Per engine step, the context length of every row the step decodes (the running sequences that have
    their first token, read as the step starts): what the roofline projection below prices. Reading it costs
    a list of lengths per step (microseconds), the same per step for both schedules."""

    def __init__(self, svc):
        self.rows: list[list[int]] = []
        inner = svc.step

        def step():
            self.rows.append([len(s) for inst in svc.instances for s in inst.sched.running if s.out])
            return inner()

        svc.step = step

    def take(self) -> list[list[int]]:
        out, self.rows = self.rows, []
        return out


def roofline_hardware(peak_json: Path):
    """Two machines for the projection, priced by the simulator's own `AnalyticCost.decode_s` (max of weight
    + KV bytes over bandwidth and FLOPs over peak, per step): this CPU at its measured float32 peak and read
    bandwidth with every efficiency 1 (no implementation of the step can beat it), and the simulator's H100
    preset (bf16, its fitted efficiencies)."""
    from jaxrl.sim.hardware import GPU, gpu

    peak = json.loads(peak_json.read_text())
    cpu = GPU("this-cpu-roofline", peak_flops=float(peak["peak_gflops"]["float32"]) * 1e9, memory_bytes=24e9,
              hbm_bw=float(peak["bandwidth_read_gbs"]) * 1e9, link_bw=1e12, net_bw=1e12, hbm_efficiency=1.0,
              decode_flops_efficiency=1.0)
    return {"cpu": (cpu, 4), "h100": (gpu("h100"), 2)}


def roofline(cfg_m, traces: dict[str, list[list[int]]], peak_json: Path) -> dict:
    """Decode seconds of each schedule's recorded steps if every step ran at a machine's roofline, and the
    speedup they imply: whether the saved decode steps can become saved seconds on that machine at all."""
    from jaxrl.sim.cost import AnalyticCost

    out = {"peak_json": str(peak_json.relative_to(ROOT)) if peak_json.is_relative_to(ROOT) else str(peak_json)}
    for name, (hw, nbytes) in roofline_hardware(peak_json).items():
        cost = AnalyticCost(cfg_m, hw, dtype_bytes=nbytes)
        secs = {k: float(sum(cost.decode_s(1, np.asarray(r, np.float64)) for r in rows if r))
                for k, rows in traces.items()}
        out[name] = {"peak_flops": hw.peak_flops * hw.decode_flops_efficiency,
                     "bandwidth": hw.hbm_bw * hw.hbm_efficiency, "dtype_bytes": nbytes,
                     "weights_read_bytes": cost.read_bytes,
                     **{f"{k}_decode_s": v for k, v in secs.items()},
                     "speedup": secs["sync"] / secs["tail_batching"], "carry_speedup": secs["sync"] / secs["carry"]}
    return out


class _Tok:
    eos_ids = ()

    def decode(self, ids):
        return ""


def model_config(quick: bool):
    """The benchmark models (tiny for --quick, hidden-512 x 8 layers otherwise): bench_rollout's."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_rollout import bench_config

    return bench_config(quick)


def make_task(n: int, median: float, sigma: float, max_len: int, vocab: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        length = int(np.clip(round(median * np.exp(sigma * rng.standard_normal())), 1, max_len))
        rows.append({"prompt_ids": rng.integers(10, vocab, size=int(rng.integers(8, 17))).tolist(),
                     "length": length, "answer": "", "task": "lengths",
                     "reward": "bench_tail_batching:zero_reward"})
    return rows


def run(args) -> dict:
    import jax

    from jaxrl.config.train import TrainConfig
    from jaxrl.data import DataLoader
    from jaxrl.rewards.pool import RewardPool
    from jaxrl.rollout import RolloutService, SamplingParams
    from jaxrl.rollout.tail_batching import Race, TailBatcher
    from jaxrl.train import rl
    from models import init

    sys.path.insert(0, str(ROOT / "scripts"))        # the pool resolves "bench_tail_batching:zero_reward"
    cfg_m = model_config(args.quick)
    weights = init(jax.random.key(0), cfg_m)
    P0, R0 = args.prompts, args.group
    base = TrainConfig()
    cfg = dataclasses.replace(base, algo=dataclasses.replace(base.algo, group_size=R0, prompts_per_step=P0),
                              rollout=dataclasses.replace(base.rollout, max_new_tokens=args.max_len, temperature=1.0))
    tb = TailBatcher(P0, R0, args.eta, args.eta)
    tc = TailBatcher(P0, R0, args.eta, args.eta, carry_partial=True, max_tokens=args.max_len)   # slime's carry
    period_prompts = 5 * P0                         # 4 short rounds draw 4 * P0/4 extra = one long round
    dataset = make_task(args.periods * period_prompts * 2, args.median, args.sigma, args.max_len, cfg_m.vocab_size,
                        args.seed)
    lengths = np.asarray([r["length"] for r in dataset])
    tail_loader = DataLoader(dataset, tb.launch, seed=args.seed)
    carry_loader = DataLoader(dataset, tb.launch, seed=args.seed)
    sync_loader = DataLoader(dataset, P0, seed=args.seed)          # the same stream, P0 at a time
    max_seqs = tb.launch * tb.responses
    page = 16
    svc = RolloutService(cfg_m, weights, page_size=page, max_batch=max_seqs, max_seq_len=16 + args.max_len,
                         num_pages=max_seqs * -(-(16 + args.max_len) // page) + 1, batch_buckets_per_octave=2)
    sample = SamplingParams.from_config(cfg.rollout, n=R0, stop_token_ids=())
    t0 = time.perf_counter()
    compiled = svc.warm([sample])
    warm_s = time.perf_counter() - t0
    trace = StepTrace(svc)
    traces = {"tail_batching": [], "carry": [], "sync": []}

    def params_fn(row, params):
        return dataclasses.replace(params, max_new_tokens=row["length"])

    def one(kind_rows, race, responses, step, schedule, carried=None):
        prompts = [r["prompt_ids"] for r in kind_rows]
        carry = schedule == "carry"
        t = time.perf_counter()
        comps, _, st = rl.rollout_and_score(svc, pool, _Tok(), cfg, prompts, kind_rows, step, (), race=race,
                                            responses=responses, params_fn=params_fn, carried=carried, carry=carry)
        sec = time.perf_counter() - t
        rows = trace.take()
        traces[schedule] += rows
        carried_in = sum(len(p.tokens) for e in carried or () if e for p in e[1])
        carried_out = sum(len(p.tokens) for parts in st.get("partials", {}).values() for p in parts)
        return {"seconds": sec, "engine_steps": st["engine_steps"], "decode_rows": sum(len(r) for r in rows),
                "trained": len(st["accepted"]),
                "decoded_tokens": sum(len(c.tokens) for c in comps) - carried_in + st["wasted_tokens"],
                "wasted_tokens": st["wasted_tokens"] - carried_out, "carried_in": carried_in,
                "carried_out": carried_out,
                "fresh_sequences": len(kind_rows) * responses - sum(len(e[1]) for e in carried or () if e),
                "max_len": max(len(c.tokens) for c in comps),
                "lengths": [r["length"] for r in kind_rows], "responses": responses}, st

    steps = []
    with RewardPool(num_workers=0) as pool:
        for step in range(args.periods * 5):
            for name, batcher, loader in (("tail_batching", tb, tail_loader), ("carry", tc, carry_loader)):
                plan = batcher.plan(lambda: next(loader), dataset, step)
                race = Race(plan.keys, plan.responses, plan.keep, plan.accept) if plan.kind == "short" else None
                got, st = one(plan.rows, race, plan.responses, step, name, plan.carried)
                row = {"step": step, "kind": plan.kind, **got}
                batcher.settle(plan, st["accepted"], step, partials=st.get("partials"))
                row["queue"] = len(batcher.queue)
                steps.append({"schedule": name, **row})
                print(f"[{name}] step {step} {plan.kind:5s} {row['seconds']:.2f} s, {row['engine_steps']} engine "
                      f"steps, max len {row['max_len']}, queue {row['queue']}, carried {row['carried_in']}", flush=True)
            rows = next(sync_loader)
            srow = {"step": step, "kind": "sync", **one(rows, None, R0, step, "sync")[0]}
            steps.append({"schedule": "sync", **srow})
            print(f"[sync] step {step} {srow['seconds']:.2f} s, {srow['engine_steps']} engine steps, "
                  f"max len {srow['max_len']}", flush=True)
    out = {"model": "quick" if args.quick else "hidden-512 x 8 layers (58M, qwen3 shape)", "prompts_per_step": P0,
           "group_size": R0, "eta_prompts": args.eta, "eta_responses": args.eta, "periods": args.periods,
           "length_median": float(np.median(lengths)), "length_p99": float(np.percentile(lengths, 99)),
           "length_p99_over_median": float(np.percentile(lengths, 99) / np.median(lengths)),
           "max_len": args.max_len, "warmup_compiles": compiled, "warmup_s": warm_s,
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "steps": steps}
    for name in ("tail_batching", "carry", "sync"):
        rows = [s for s in steps if s["schedule"] == name]
        trained = sum(s["trained"] for s in rows)
        out[name] = {"seconds": sum(s["seconds"] for s in rows), "trained_prompts": trained,
                     "seconds_per_trained_prompt": sum(s["seconds"] for s in rows) / trained,
                     "engine_steps": sum(s["engine_steps"] for s in rows),
                     "decoded_tokens": sum(s["decoded_tokens"] for s in rows),
                     "wasted_tokens": sum(s["wasted_tokens"] for s in rows),
                     "carried_tokens": sum(s["carried_in"] for s in rows)}
    out["speedup"] = out["sync"]["seconds_per_trained_prompt"] / out["tail_batching"]["seconds_per_trained_prompt"]
    out["engine_step_ratio"] = out["sync"]["engine_steps"] / out["tail_batching"]["engine_steps"]
    out["carry_speedup"] = out["sync"]["seconds_per_trained_prompt"] / out["carry"]["seconds_per_trained_prompt"]
    out["carry_engine_step_ratio"] = out["sync"]["engine_steps"] / out["carry"]["engine_steps"]
    for name in ("tail_batching", "carry", "sync"):
        n = out[name]
        n["traced_steps"] = len(traces[name])
        n["decode_steps"] = sum(1 for r in traces[name] if r)
        n["decode_rows_per_step"] = sum(len(r) for r in traces[name]) / max(1, n["decode_steps"])
        n["seconds_per_engine_step"] = n["seconds"] / max(1, n["engine_steps"])
    out["roofline"] = roofline(cfg_m, traces, Path(args.peak_json))
    return out


def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    n = out["periods"] * 5
    sync = [s["seconds"] for s in out["steps"] if s["schedule"] == "sync"]
    tail = [s for s in out["steps"] if s["schedule"] == "tail_batching"]
    carry = [s for s in out["steps"] if s["schedule"] == "carry"]
    x = np.arange(n)
    ax.bar(x - 0.27, sync, 0.27, label="synchronous", color="tab:gray")
    ax.bar(x, [s["seconds"] for s in tail], 0.27, label="tail batching",
           color=["tab:red" if s["kind"] == "long" else "tab:blue" for s in tail])
    ax.bar(x + 0.27, [s["seconds"] for s in carry], 0.27, label="+ carried partials",
           color=["tab:orange" if s["kind"] == "long" else "tab:cyan" for s in carry])
    ax.set_xlabel("RL step (red/orange: long round)")
    ax.set_ylabel("rollout seconds")
    ax.set_title(f"rollout time per trained prompt vs synchronous (CPU, P0={out['prompts_per_step']}, "
                 f"R0={out['group_size']}): tail batching {out['speedup']:.2f}x, with carried partials "
                 f"{out['carry_speedup']:.2f}x", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "bench_tail_batching.json"))
    ap.add_argument("--quick", action="store_true", help="tiny model and sizes (a smoke test)")
    ap.add_argument("--periods", type=int, default=None, help="whole periods of 4 short + 1 long round")
    ap.add_argument("--prompts", type=int, default=None, help="P0, prompts trained per step")
    ap.add_argument("--group", type=int, default=None, help="R0, responses per prompt")
    ap.add_argument("--eta", type=float, default=1.25, help="speculation factor for prompts and responses")
    ap.add_argument("--median", type=float, default=None, help="median response length")
    ap.add_argument("--sigma", type=float, default=1.3, help="log-normal sigma of the response lengths")
    ap.add_argument("--max-len", type=int, default=None, help="longest response")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peak-json", default=str(ROOT / "scripts" / "results" / "bench_peak.json"),
                    help="this machine's measured peak and bandwidth (scripts/bench_peak.py) for the roofline")
    args = ap.parse_args(argv)
    q = args.quick
    args.periods = args.periods or (1 if q else 2)
    args.prompts = args.prompts or (4 if q else 16)
    args.group = args.group or (2 if q else 4)
    args.median = args.median or (5 if q else 20)
    args.max_len = args.max_len or (64 if q else 320)
    try:                                            # the roofline's inputs, checked before minutes of rollout
        roofline_hardware(Path(args.peak_json))
    except (OSError, KeyError, ValueError) as e:
        ap.error(f"--peak-json {args.peak_json}: {e!r} (run scripts/bench_peak.py to measure this machine)")
    out = run(args)
    path = write_result(args.out, out)
    plot(out, path.with_suffix(".png"))
    rl = out["roofline"]
    print(f"speedup {out['speedup']:.2f}x (engine steps {out['engine_step_ratio']:.2f}x fewer; at the roofline: "
          f"{rl['cpu']['speedup']:.2f}x on this CPU, {rl['h100']['speedup']:.2f}x on an H100); with carried "
          f"partials {out['carry_speedup']:.2f}x ({out['carry_engine_step_ratio']:.2f}x fewer engine steps; "
          f"roofline {rl['cpu']['carry_speedup']:.2f}x CPU, {rl['h100']['carry_speedup']:.2f}x H100); wrote {path}")
    return out


if __name__ == "__main__":
    main()
