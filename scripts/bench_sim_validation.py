"""The simulator against the real engine on this CPU: the same decisions, and its times within 15%.

    python scripts/bench_sim_validation.py --out scripts/results/bench_sim_validation.json
    python scripts/bench_sim_validation.py --quick --out /tmp/v.json      # tiny model, 2 rows (smoke test)

1. A latency profile of the validation model's pool (8 fake devices, TP 1, 2, 4) by the real profiler
   (`jaxrl.rollout.profile.run_profile`), cached beside the output.
2. Each row (mechanism set) runs the same RL steps' rollouts twice through the same driver
   (`jaxrl.sim.run.RowSim`): on the real `RolloutService` against the wall clock, and on the simulator's
   `SimService` with `ProfileCost(profile)` on the virtual clock. Every response is forced to its workload
   length (max_new_tokens per prompt, no stop token), so the real model cannot end one early. Each real
   row runs twice: the first pass compiles the shapes it uses, the second (timed) compiles nothing.
3. Per step: the round type, engine steps, preemptions and layout switches must be equal; the rollout's
   seconds are compared (simulated / measured). `max_abs_time_error`: the worst step of any row.

Run it on an idle machine: the measured side is wall time. The training side (forwards, update, sync) is
not part of this comparison (its CPU cost is per token; the README's cluster tables model it analytically).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import numpy as np  # noqa: E402

from bench_harness import write_result  # noqa: E402

# its files in scripts/results/ (tests/test_docs.py)
OUTPUTS = ("bench_sim_validation.json", "bench_sim_validation_profile.json")


def model_config(quick: bool):
    from models import ModelConfig

    if quick:
        return ModelConfig(architecture="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                           num_heads=8, num_kv_heads=4, head_dim=16, rope_theta=1e6, max_position_embeddings=1024,
                           qk_norm=True, tie_embeddings=True)
    return ModelConfig(architecture="qwen3", vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=4,
                       num_heads=8, num_kv_heads=4, head_dim=32, rope_theta=1e6, max_position_embeddings=1024,
                       qk_norm=True, tie_embeddings=True)


class WallClock:
    """The wall clock as `RowSim` reads it (setting `now` is ignored: real time only moves on)."""

    def __init__(self):
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.t0

    @property
    def now(self) -> float:
        return self()

    @now.setter
    def now(self, value: float) -> None:
        pass

    def advance(self, seconds: float) -> float:
        return self()


def recording_service(model_cfg, weights):
    """The real `RolloutService` as RowSim drives it: relayout reports and retired instances' preemptions
    are recorded (what `SimService` keeps itself)."""
    import jax

    from jaxrl.rollout import RolloutService

    class Recording(RolloutService):
        def relayout(self, *a, **kw):
            old = sum(i.sched.preemptions for i in self.instances)
            rep = super().relayout(*a, **kw)
            self.relayouts.append(rep)
            self.retired_preemptions += old
            return rep

    def build(rs):
        e = rs.tc.engine
        svc = Recording(model_cfg, weights, tp=e.tp, instances=e.instances, devices=jax.devices()[:rs.gen_gpus],
                        page_size=e.page_size, num_pages=e.num_pages, kv_bytes_per_device=e.kv_bytes_per_device,
                        max_batch=e.max_batch, max_seq_len=e.max_seq_len, prefill_chunk=e.prefill_chunk,
                        prefill_tokens=e.prefill_tokens, prefix_sharing=e.prefix_sharing, overlap=e.overlap,
                        batch_buckets_per_octave=e.batch_buckets_per_octave, page_buckets=e.page_buckets,
                        order=rs.order)
        svc.relayouts, svc.retired_preemptions = [], 0
        svc.clock = rs.clock
        return svc

    return build


def run_row(cfg, row, model_cfg, weights, workload, profile_path, *, real: bool):
    from jaxrl.sim.cost import ProfileCost
    from jaxrl.sim.run import RowSim
    from jaxrl.rollout.adaptive_tp import Profile

    def params_fn(r, p):
        return dataclasses.replace(p, max_new_tokens=workload.length(r["index"], 0), stop_token_ids=())

    cost = ProfileCost(Profile.load(profile_path), model_cfg, dtype_bytes=4, num_pages=cfg.engine.num_pages,
                       kv_bytes_per_device=cfg.engine.kv_bytes_per_device)
    kw = dict(engine=recording_service(model_cfg, weights), clock=WallClock()) if real else {}
    sim = RowSim(cfg, row, cost, workload, profile=profile_path, params_fn=params_fn, **kw)
    out = []
    for k in range(cfg.steps):
        rec = sim.step(k)
        out.append({"kind": rec.kind, "engine_steps": rec.engine_steps, "preemptions": rec.preemptions,
                    "switches": rec.switches, "rollout_s": rec.rollout_s, "samples": rec.samples,
                    "response_tokens": rec.response_tokens, "tp": rec.tp})
    return out


def main(argv=None) -> int:
    from jaxrl.runtime import request_cpu_devices

    request_cpu_devices(8)          # 8 fake CPU devices (before anything starts JAX's backend)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "scripts/results/bench_sim_validation.json"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--only", action="append", help="run this row only (repeatable); the out file's other rows stay")
    args = ap.parse_args(argv)
    import jax

    from jaxrl.config.train import AlgoSection
    from jaxrl.config.train_rollout import TrainEngineSection, TrainSamplingSection
    from jaxrl.config.planner import PlannerSection
    from jaxrl.config.adaptive_tp import AdaptiveTPSection
    from jaxrl.rollout import CACHE
    from jaxrl.rollout.profile import run_profile
    from jaxrl.sim.config import ClusterSection, SimConfig, WorkloadSection
    from models import init

    quick = args.quick
    model_cfg = model_config(quick)
    weights = init(jax.random.key(0), model_cfg)
    max_new = 96 if quick else 320
    engine = TrainEngineSection(tp=2, instances=4, page_size=16, max_batch=16 if quick else 32,
                                max_seq_len=max_new + 48,
                                kv_bytes_per_device=None, adaptive_tp=AdaptiveTPSection(check_every=8),
                                planner=PlannerSection())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    prof_path = out.with_name(out.stem + "_profile.json")
    if not prof_path.exists():
        t0 = time.perf_counter()
        prof = run_profile(model_cfg, weights, engine, candidates=[1, 2, 4], batches=6 if quick else 8,
                           decode_steps=4 if quick else 8)
        prof.key["devices"] = 8
        prof.save(prof_path)
        print(f"[validation] profiled in {time.perf_counter() - t0:.0f} s -> {prof_path}", file=sys.stderr)
    cfg = SimConfig(model="tiny-qwen3", cluster=ClusterSection(gpus=8, dtype="float32", profile=str(prof_path)),
                    workload=WorkloadSection(median=12 if quick else 40, above=48 if quick else 160,
                                             above_fraction=0.08, prompt_share=1.0, prompt_len=32, reward_s=0.0),
                    rollout=TrainSamplingSection(max_new_tokens=max_new), engine=engine,
                    algo=AlgoSection(prompts_per_step=8 if quick else 16, group_size=4), steps=args.steps)
    import models

    models.PRESETS["sim-validation"] = model_cfg      # the row driver reads `cfg.model` as a preset name
    cfg = dataclasses.replace(cfg, model="sim-validation")
    workload = cfg.workload.build(max_new)
    # PAT starts on TP4x2 so that its controller has somewhere to go (on this CPU smaller TP predicts faster);
    # RollPacker's planner on a pool small enough to preempt at TP1 (a per-device budget of the weights + ~4 MB)
    budget = 4_000_000 + 4 * model_cfg.param_count()
    rows = [("baseline", 2, {}), ("pat", 4, {})] if quick else \
        [("baseline", 2, {}), ("tail_batching", 2, {}), ("pat", 4, {}), ("tail_batching+pat", 4, {}),
         ("planner", 1, {"kv_bytes_per_device": budget})]
    if args.only:
        unknown = set(args.only) - {r[0] for r in rows}
        if unknown:
            raise SystemExit(f"--only: unknown rows {sorted(unknown)}; valid: {[r[0] for r in rows]}")
        rows = [r for r in rows if r[0] in args.only]
    kept = json.loads(out.read_text())["rows"] if args.only and out.exists() else []
    results = []
    base_engine = cfg.engine
    for row, tp, extra in rows:
        cfg = dataclasses.replace(cfg, engine=dataclasses.replace(base_engine, tp=tp, instances=8 // tp, **extra))
        sim = run_row(cfg, row, model_cfg, weights, workload, str(prof_path), real=False)
        CACHE.clear()
        jax.clear_caches()
        # the first real pass compiles the shapes this row uses; the second, timed, compiles nothing
        run_row(cfg, row, model_cfg, weights, workload, str(prof_path), real=True)
        compiles = CACHE.compiles
        real = run_row(cfg, row, model_cfg, weights, workload, str(prof_path), real=True)
        if CACHE.compiles != compiles:
            raise RuntimeError(f"{row}: the timed pass compiled {CACHE.compiles - compiles} executables")
        keys = ("kind", "engine_steps", "preemptions", "switches", "samples", "response_tokens")
        equal = all(all(s[k] == r[k] for k in keys) for s, r in zip(sim, real))
        ratios = [s["rollout_s"] / r["rollout_s"] for s, r in zip(sim, real)]
        results.append({"row": row, "start_tp": tp, "counts_equal": equal, "time_ratio_mean": float(np.mean(ratios)),
                        "time_error_max": float(max(abs(x - 1) for x in ratios)),
                        "rollout_s_real": sum(r["rollout_s"] for r in real),
                        "rollout_s_sim": sum(s["rollout_s"] for s in sim), "steps": [
                            {"sim": s, "real": r} for s, r in zip(sim, real)]})
        print(f"[validation] {row:>20}: counts equal {equal}; rollout {results[-1]['rollout_s_sim']:.2f} s simulated "
              f"vs {results[-1]['rollout_s_real']:.2f} s measured (worst step {results[-1]['time_error_max']:.1%})",
              file=sys.stderr)
    order = [r["row"] for r in kept] + [r["row"] for r in results if r["row"] not in {k["row"] for k in kept}]
    results = [next(r for r in results + kept if r["row"] == name) for name in order]   # new rows replace old ones
    summary = {"model_params": model_cfg.param_count(), "engine": dataclasses.asdict(engine), "workload":
               workload.summary(), "rows": results, "all_counts_equal": all(r["counts_equal"] for r in results),
               "max_abs_time_error": max(r["time_error_max"] for r in results),
               "total_time_error": float(sum(r["rollout_s_sim"] for r in results) /
                                         sum(r["rollout_s_real"] for r in results) - 1)}
    write_result(out, summary, default=str)
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
