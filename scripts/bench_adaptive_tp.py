"""PAT on the CPU: switch cost against a naive restart, and the latency predictor's accuracy.

    python scripts/bench_adaptive_tp.py                       # hidden-512 x 8 layers (58M), writes
                                                              # scripts/results/bench_adaptive_tp.{json,png}
    python scripts/bench_adaptive_tp.py --quick --out /tmp/a.json   # tiny model, small grid (a smoke test)

1. Profile (`jaxrl.rollout.profile.run_profile`) the pool of 8 devices: TP 1, 2, 4, 8 on dummy batches.
2. Predictor accuracy: per layout, a real long-tail generation on one TP group (requests with log-normal
   lengths, so the batch shrinks while contexts grow); each of its first `--max-steps` decode steps'
   measured time (the median of `--repeats` runs of the same greedy generation) against ℓ(B, T; tp) from
   the profile, which maps the batch to the padded shape the XLA engine runs (rows bucket, page-table
   width of the longest sequence: `adaptive_tp.Padded`). `predictor_mape[tp]` = mean |predicted −
   measured| / measured.
3. Switch cost, late in a long-tail generation (TP2x4 -> TP4x2 after 80% of the requests finished; TP8x1 with
   `--target-tp 8` on a machine where it runs: on this 2-core CPU, compiling and running the 58M model's
   large TP8 shapes leaves XLA:CPU's 8 collective threads waiting past its 40 s rendezvous timeout and the
   process aborts), from
   the same state three ways: PAT with the KV migrated, PAT with the KV recomputed (the switch plus the
   re-prefill), and a naive restart (tear the service down, build the target layout from weights in host
   memory, re-prefill every unfinished sequence), each up to and including the first decode step on the
   target layout. Executables compile lazily (only the shapes used). Each PAT path runs twice from the same
   state: cold (the target layout's executables and the KV staging compile on first use, as on a layout's
   first switch) and warm (every later switch; the trainer's warm-up makes even the first one warm).
   Breakdown: weights, KV (move or re-prefill), compile (XLA seconds in the window), control (the rest).
   The naive restart's compile may read the persistent compilation cache (in-memory caches are cleared):
   a conservative cost.
   `switch_speedup` = naive ÷ the faster PAT path.

The CPU's 8 fake devices share 2 cores, so a larger TP is not faster here and no end-to-end latency gain
is claimed; what the CPU shows is the switch cost and the predictor's accuracy.
"""

from __future__ import annotations

import argparse
import gc
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

# its files in scripts/results/ (tests/test_docs.py)
OUTPUTS = ("bench_adaptive_tp.json", "bench_adaptive_tp.png",
           "bench_adaptive_tp_profile.json", "bench_adaptive_tp_trajectories.json")


def model_config(quick: bool):
    """The benchmark models (tiny for --quick, hidden-512 x 8 layers otherwise): bench_rollout's."""
    from bench_rollout import bench_config

    return bench_config(quick)


def requests(n: int, seed: int, vocab: int, median: float, max_new: int):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, vocab, int(rng.integers(16, 64))).tolist() for _ in range(n)]
    lens = np.clip((median * np.exp(1.0 * rng.standard_normal(n))).astype(int), 2, max_new)
    return prompts, lens.tolist()


def trajectory(svc, prompts, lens, max_steps: int) -> list[tuple[int, int, float, int]]:
    """(batch, context tokens, seconds, longest context) of the first `max_steps` decode steps of instance 0 once all requests
    are prefilled (the batch shrinks as the short requests finish); the rest is aborted."""
    from jaxrl.rollout import SamplingParams

    for p, n in zip(prompts, lens):
        svc.add(p, SamplingParams(max_new_tokens=int(n), temperature=0.0, stop_token_ids=()), instance=0)
    while any(s["state"] != "running" or s["generated"] < 1 for s in svc.sequence_stats()):
        svc.step()
    out = []
    t0 = time.perf_counter()
    while svc.has_work() and len(out) < max_steps:
        # each step timed from the end of the one before, back to back as the engine runs: `step()` returns
        # with work in flight, which timing the call alone (with a gap before the next) would leave out
        st = svc.sequence_stats()
        b, t, longest = len(st), sum(s["context_len"] for s in st), max(s["context_len"] for s in st)
        svc.step()
        t1 = time.perf_counter()
        out.append((b, t, t1 - t0, longest))
        t0 = t1
    for r in svc.live():
        svc.abort(r)
    return out


def predict(pred, rows, tp) -> list[float]:
    """ℓ for each recorded step (with its longest context when recorded: a padded profile uses it)."""
    return [float(pred.step_latency(tp, r[0], r[1], r[3] if len(r) > 3 else None)) for r in rows]


def mape(pred, rows, tp) -> float:
    if not rows:
        return float("nan")
    p = np.asarray(predict(pred, rows, tp))
    m = np.asarray([r[2] for r in rows])
    return float(np.mean(np.abs(p - m) / m))


def repeated(svc, prompts, lens, max_steps: int, repeats: int) -> list[tuple[int, int, float, int]]:
    """The same greedy trajectory `repeats` times (identical batches and contexts, checked); each step's
    time is the median over the repeats (timing noise of a shared 2-core host, not a model effect)."""
    runs = [trajectory(svc, prompts, lens, max_steps) for _ in range(repeats)]
    shape = [(b, t, lm) for b, t, _, lm in runs[0]]
    if any([(b, t, lm) for b, t, _, lm in r] != shape for r in runs[1:]):
        raise RuntimeError("repeated trajectories differ in batch or context: not the same generation")
    return [(b, t, float(np.median([r[i][2] for r in runs])), lm) for i, (b, t, lm) in enumerate(shape)]


def with_shapes(prof, engine, devices: int = 8):
    """A profile measured before shapes were recorded: the padded decode shapes of each layout's instances
    are a function of the engine config (as `run_profile` builds the services), so they are filled in."""
    from jaxrl.rollout.shapes import ShapeBuckets

    total = engine.max_batch * engine.instances
    for tp, lp in prof.layouts.items():
        if lp.shapes is None:
            sh = ShapeBuckets.build(max_batch=max(1, total * tp // devices), max_seq_len=engine.max_seq_len,
                                    page_size=engine.page_size, prefill_chunk=engine.prefill_chunk,
                                    prefill_tokens=engine.prefill_tokens, per_octave=engine.batch_buckets_per_octave,
                                    page_buckets=engine.page_buckets)
            lp.shapes = {"batch": list(sh.batch), "pages": list(sh.pages), "page_size": sh.page_size}
    return prof


def run_to_late(engine, model_cfg, weights, prompts, lens, frac: float):
    """A fresh TP2x4 service generating until `frac` of the requests finished (executables compile lazily:
    only the shapes this generation uses); returns it paused."""
    from jaxrl.rollout import RolloutService, SamplingParams

    svc = RolloutService.from_config(engine, model_cfg, weights)
    for k, (p, n) in enumerate(zip(prompts, lens)):
        svc.add(p, SamplingParams(max_new_tokens=int(n), temperature=0.0, stop_token_ids=()), instance=k % 4)
    done = 0
    while done < frac * len(prompts):
        done += len(svc.step())
    svc.pause()
    return svc


def resume(svc) -> None:
    """Until every live sequence has its KV again (re-prefill after a recompute), then one decode step."""
    while any(s["state"] != "running" for s in svc.sequence_stats()):
        svc.step()
    svc.step()
    svc.pause()


def switch_costs(engine, model_cfg, weights, prompts, lens, frac: float, target: int) -> dict:
    """Each path from the same state: the switch, the re-prefill if any, and the first decode step on the
    target layout. compile_s = XLA compile seconds inside that window (the executable cache's counter)."""
    import jax

    from jaxrl.rollout import CACHE, RolloutService, SamplingParams

    out = {}
    # each PAT path twice from the same state: cold (the target's executables and the KV staging compile on
    # first use, as on a layout's first switch) and warm (the steady state: every later switch)
    for name, kv in (("pat_migrate_cold", "migrate"), ("pat_migrate", "migrate"),
                     ("pat_recompute_cold", "recompute"), ("pat_recompute", "recompute")):
        svc = run_to_late(engine, model_cfg, weights, prompts, lens, frac)
        live = len(svc.live())
        c0 = CACHE.compile_s
        t0 = time.perf_counter()
        rep = svc.relayout(target, 8 // target, kv=kv)
        t1 = time.perf_counter()
        resume(svc)
        total = time.perf_counter() - t0
        compile_s = CACHE.compile_s - c0
        kv_s = rep.kv.seconds + (time.perf_counter() - t1) - compile_s
        out[name] = {"seconds": total, "weights_s": rep.weight_seconds, "kv_s": kv_s, "compile_s": compile_s,
                     "control_s": total - rep.weight_seconds - kv_s - compile_s, "live": live,
                     "kv_bytes": rep.kv.kv_bytes, "weight_bytes": rep.weight_bytes,
                     "weight_bytes_contiguous": rep.weight_bytes_contiguous}
        for r in svc.live():
            svc.abort(r)
        del svc
        gc.collect()
    # naive restart from the same state: unfinished sequences' tokens, weights from host memory
    svc = run_to_late(engine, model_cfg, weights, prompts, lens, frac)
    host = jax.device_get(weights)
    pending = [(s["request_id"], s["max_new_tokens"] - s["generated"]) for s in svc.sequence_stats()]
    parts = {}
    for rid, _ in pending:
        c = svc.abort(rid)
        parts[rid] = list(c.prompt) + list(c.tokens)
    t0 = time.perf_counter()
    for inst in svc.instances:                            # tear down
        inst.kv.delete()
    del svc
    gc.collect()
    CACHE.clear()
    jax.clear_caches()
    t1 = time.perf_counter()
    host = jax.tree.map(lambda x: jax.device_put(x, jax.devices()[0]), host)     # host memory -> a device
    new = RolloutService(model_cfg, host, tp=target, instances=8 // target, page_size=engine.page_size,
                         max_batch=engine.max_batch * engine.instances * target // 8, max_seq_len=engine.max_seq_len,
                         kv_bytes_per_device=engine.kv_bytes_per_device, num_pages=None, overlap=engine.overlap,
                         devices=jax.devices()[:8])
    jax.block_until_ready(new.instances[0].weights)
    t2 = time.perf_counter()
    c0 = CACHE.compile_s
    for rid, left in pending:
        new.add(parts[rid], SamplingParams(max_new_tokens=max(1, int(left)), temperature=0.0, stop_token_ids=()))
    resume(new)
    t3 = time.perf_counter()
    compile_s = CACHE.compile_s - c0
    out["naive_restart"] = {"seconds": t3 - t0, "weights_s": t2 - t1, "kv_s": t3 - t2 - compile_s,
                            "compile_s": compile_s, "control_s": t1 - t0, "live": len(pending)}
    best = min(out["pat_migrate"]["seconds"], out["pat_recompute"]["seconds"])
    out["switch_speedup"] = out["naive_restart"]["seconds"] / best
    return out


def free_executables() -> None:
    """Drop compiled executables: each XLA:CPU executable holds ~30 memory mappings with 8 devices and a process
    may have 65530 (vm.max_map_count); past that LLVM fails with "Cannot allocate memory"."""
    import jax

    from jaxrl.rollout import CACHE

    CACHE.clear()
    jax.clear_caches()
    gc.collect()


def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(10, 3.5))
    names = ["pat_migrate_cold", "pat_migrate", "pat_recompute_cold", "pat_recompute", "naive_restart"]
    bottom = np.zeros(len(names))
    for part in ("weights_s", "kv_s", "compile_s", "control_s"):
        vals = np.asarray([max(out["switch"][n][part], 0.0) for n in names])
        ax0.bar(names, vals, bottom=bottom, label=part)
        bottom += vals
    ax0.set_ylabel("seconds")
    ax0.set_xticks(range(len(names)))
    ax0.set_xticklabels([n.replace("_", "\n", 1) for n in names], fontsize=7)
    ax0.set_title(f"switch cost (speed-up {out['switch_speedup']:.1f}x)")
    ax0.legend(fontsize=7)
    for tp, rows in out["trajectories"].items():
        rows = np.asarray(rows)
        if len(rows):
            ax1.plot(rows[:, 1], rows[:, 2] * 1e3, ".", ms=2, label=f"TP {tp} measured")
            ax1.plot(rows[:, 1], np.asarray(out["predicted"][tp]) * 1e3, "-", lw=0.8, label=f"TP {tp} predicted")
    ax1.set_yscale("log")
    ax1.set_xlabel("context tokens T (group 0)")
    ax1.set_ylabel("decode step (ms)")
    ax1.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    from jaxrl.runtime import request_cpu_devices

    request_cpu_devices(8)          # 8 fake CPU devices (before anything starts JAX's backend)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "bench_adaptive_tp.json"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--decode-steps", type=int, default=None, help="decode steps per profiled point")
    ap.add_argument("--profile", default=None, help="reuse this profile JSON (written by an earlier run)")
    ap.add_argument("--max-steps", type=int, default=None, help="decode steps timed per trajectory")
    ap.add_argument("--repeats", type=int, default=None, help="runs of each trajectory (median per step; 3)")
    ap.add_argument("--target-tp", type=int, default=4, help="the switch's target TP (from TP2x4)")
    ap.add_argument("--trajectories", default=None, help="reuse phase 2 (the *_trajectories.json of a run)")
    args = ap.parse_args(argv)
    import dataclasses

    import jax

    from jaxrl.config.generate import EngineSection
    from jaxrl.rollout.adaptive_tp import Predictor, Profile
    from jaxrl.rollout.profile import run_profile
    from jaxrl.rollout.service import RolloutService
    from models import init

    q = args.quick
    cfg = model_config(q)
    weights = init(jax.random.key(0), cfg)
    engine = EngineSection(tp=2, instances=4, max_batch=8 if q else 16, max_seq_len=128 if q else 512,
                           page_size=16, overlap=False)
    steps = args.decode_steps or (2 if q else 4)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.profile:
        prof = with_shapes(Profile.load(args.profile), engine)
    else:
        prof = run_profile(cfg, weights, engine, candidates=[1, 2, 4, 8], batches=2 if q else 6,
                           contexts=[16, 48] if q else [16, 96, 192, 384], decode_steps=steps)
        prof.save(path.with_name(path.stem + "_profile.json"))
    profile_s = time.perf_counter() - t0
    pred = Predictor(prof)
    total_batch = engine.max_batch * engine.instances
    trajectories, predicted, errors, errors_sum = {}, {}, {}, {}
    paper = Predictor(Profile.from_json({**prof.to_json(), "layouts": {
        k: {**v, "shapes": None} for k, v in prof.to_json()["layouts"].items()}}))   # the paper's T = Σ context
    if args.trajectories:          # an earlier run's phase 2 (predictions recomputed from this profile)
        got = json.loads(Path(args.trajectories).read_text())
        trajectories = {int(k): v for k, v in got["trajectories"].items()}
        predicted = {tp: predict(pred, rows, tp) for tp, rows in trajectories.items()}
        errors = {tp: mape(pred, rows, tp) for tp, rows in trajectories.items()}
        errors_sum = {tp: mape(paper, rows, tp) for tp, rows in trajectories.items()}
    for tp in [t for t in (1, 2, 4, 8) if t not in trajectories]:
        svc = RolloutService.from_config(dataclasses.replace(engine, tp=tp, instances=8 // tp,
                                                             max_batch=total_batch * tp // 8), cfg, weights)
        if not q:
            svc.instances[0].warm()            # the trajectory runs on the first TP group (--quick: lazily)
        # at most 32 requests: a TP8 step of 64 long prompts starves XLA:CPU's 8 collective threads on 2 cores
        # past its 40 s rendezvous timeout (the process aborts)
        n_req = min(total_batch * tp // 8, 32)
        prompts, lens = requests(n_req, tp, cfg.vocab_size, 8 if q else 40, 40 if q else 300)
        rows = repeated(svc, prompts, lens, args.max_steps or (6 if q else 60), args.repeats or (1 if q else 3))
        trajectories[tp] = [list(r) for r in rows]
        predicted[tp] = predict(pred, rows, tp)
        errors[tp] = mape(pred, rows, tp)
        errors_sum[tp] = mape(paper, rows, tp)
        print(f"TP {tp}: {len(rows)} decode steps, MAPE {errors[tp]:.1%} (T = sum of contexts: {errors_sum[tp]:.1%})",
              flush=True)
        del svc
        free_executables()
    partial = path.with_name(path.stem + "_trajectories.json")
    write_result(partial, {"trajectories": trajectories, "predicted": predicted, "errors": errors}, indent=None)
    prompts, lens = requests(total_batch, 99, cfg.vocab_size, 8 if q else 40, 40 if q else 300)
    sw = switch_costs(engine, cfg, weights, prompts, lens, 0.8, args.target_tp)
    out = {"model": "quick" if q else "hidden-512 x 8 layers (58M, qwen3 shape)", "profile_s": profile_s,
           "switch_from_to": [2, args.target_tp],
           "profile_points": {tp: len(lp.decode) for tp, lp in prof.layouts.items()},
           "decode_steps_per_point": steps, "predictor_mape": {str(k): v for k, v in errors.items()},
           "predictor_mape_sum": {str(k): v for k, v in errors_sum.items()},
           "switch_speedup": sw.pop("switch_speedup"), "switch": sw,
           "switch_breakdown": {k: {p: v[p] for p in ("weights_s", "kv_s", "compile_s", "control_s")}
                                for k, v in sw.items()},
           "trajectories": {str(k): v for k, v in trajectories.items()},
           "predicted": {str(k): v for k, v in predicted.items()},
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}}
    write_result(path, out)
    plot(out, path.with_suffix(".png"))
    print(json.dumps({k: out[k] for k in ("predictor_mape", "switch_speedup", "switch_breakdown")}, indent=1))
    return out


if __name__ == "__main__":
    main()
