"""`scripts/gpu_check.py` sections "profile" and "targets" (one process in a full run: the targets reuse the
profile's compiled steps).

profile  PAT's offline profiler (`jaxrl.rollout.profile.run_profile`) on one device, TP 1, `grid=shapes` (every
         decode rows bucket x one context per page-table width: the shapes the XLA engine runs), qwen3-0.6b shape
         in bfloat16 with random weights, max_batch 16, max_seq_len 256, a pool of 513 pages; saved as
         OUT/gpu_check_profile.json (+ its PNG), which `python -m jaxrl.sim model=qwen3-0.6b
         cluster.profile=OUT/gpu_check_profile.json engine.tp=1 engine.instances=8 'rows=[baseline,tail_batching]'`
         reads (a TP1-only profile: no layout to switch to, so rows with PAT need a profile with more TP sizes).
         Checked here: it loads through the simulator's own loader (`jaxrl.sim.simulate.build_cost`).
targets  the two figures only a GPU can settle (recorded on the CPU too, where `applies` is false):
         predictor_mape  PAT's predictor on the profile just written (loaded back from the file) against a
                         long-tail greedy generation on the same engine (scripts/bench_adaptive_tp.py's `requests`,
                         `repeated`, `mape`: each step the median of 3 runs); target MAPE <= 4% (PAT's paper).
         tail_batching   scripts/bench_tail_batching.py's `run` (tail batching vs synchronous rollout, the same
                         prompt stream, interleaved) shortened to one period (4 short + 1 long round) of 8 prompts x 4
                         responses, median length 8 and at most 112 tokens (p99 / median ~ 14; max_seq_len 128 is one
                         page-table width, so its warm-up compiles ~16 steps, not ~40), on the qwen3-0.6b shape
                         (float32, as that script initialises it); target: sync / tail-batching seconds per trained
                         prompt >= 2.
         The roofline the script adds is priced with this device's measured peak and read bandwidth.
"""

from __future__ import annotations

import argparse

from gpu_check_common import Section, peak_json

PROFILE = dict(max_batch=16, max_seq_len=256, decode_steps=16)
TRAJECTORY = dict(requests=16, median=40, max_new=180, steps=60, repeats=3)
TAIL = dict(periods=1, prompts=8, group=4, median=8.0, max_len=112)
SMOKE_PROFILE = dict(max_batch=2, max_seq_len=128, decode_steps=4)
SMOKE_TRAJECTORY = dict(requests=2, median=8, max_new=16, steps=6, repeats=1)
SMOKE_TAIL = dict(periods=1, prompts=2, group=2, median=4.0, max_len=16)
MAPE_TARGET, TAIL_TARGET = 0.04, 2.0
PROFILE_FILE = "gpu_check_profile.json"


def _model(s: Section):
    """(preset name, config, dtype, weights), built once per process and shared by both sections."""
    if "pat_model" not in s.shared:
        import jax
        import jax.numpy as jnp

        from models import PRESETS, init

        name, dtype = ("tiny-qwen3", jnp.float32) if s.smoke else ("qwen3-0.6b", jnp.bfloat16)
        cfg = PRESETS[name]
        s.shared["pat_model"] = (name, cfg, dtype, init(jax.random.key(0), cfg, dtype))
    return s.shared["pat_model"]


def _engine(s: Section):
    from jaxrl.config.generate import EngineSection

    p = SMOKE_PROFILE if s.smoke else PROFILE
    # a pool of twice the grid's largest need (the default, half the device's memory, is ~40 GB on an H100, and the
    # profiler's relayout builds a second pool beside the first)
    pages = 2 * p["max_batch"] * -(-p["max_seq_len"] // 16) + 1
    return EngineSection(tp=1, instances=1, max_batch=p["max_batch"], max_seq_len=p["max_seq_len"], page_size=16,
                         num_pages=pages)


def run_profile_section(s: Section) -> None:
    out = s.shared["out"]
    path = out / PROFILE_FILE

    def measure():
        import jax.numpy as jnp

        from jaxrl.rollout.profile import plot, run_profile

        name, cfg, dtype, weights = _model(s)
        engine = _engine(s)
        steps = (SMOKE_PROFILE if s.smoke else PROFILE)["decode_steps"]
        prof = run_profile(cfg, weights, engine, candidates=[1], decode_steps=steps, grid="shapes", progress=False)
        prof.save(path)
        plot(prof, path.with_suffix(".png"))
        lp = prof.layouts[1]
        return {"path": path.name, "model": name, "dtype": jnp.dtype(dtype).name,
                "engine": {k: getattr(engine, k) for k in ("max_batch", "max_seq_len", "page_size")},
                "decode_steps": steps, "points": len(lp.decode), "compile_s": lp.compile_seconds,
                "decode_ms_min": 1e3 * min(r[2] for r in lp.decode),
                "decode_ms_max": 1e3 * max(r[2] for r in lp.decode),
                "key": prof.key}

    def loads():
        from jaxrl.rollout.adaptive_tp import Profile
        from jaxrl.sim.config import ClusterSection, SimConfig
        from jaxrl.sim.simulate import build_cost

        name, cfg, dtype, _ = _model(s)
        prof = Profile.load(path)
        dt = "float32" if s.smoke else "bfloat16"
        sim = SimConfig(model=name, cluster=ClusterSection(profile=str(path), dtype=dt, gpus=1))
        cost = build_cost(sim, cfg)
        b, ctx = prof.layouts[1].decode[0][:2]
        return {"loader": "jaxrl.sim.simulate.build_cost", "cost_model": cost.name,
                "predicted_step_s": float(cost.predictor.step_latency(1, b, ctx)),
                "sim_command": f"python -m jaxrl.sim model={name} cluster.profile={path.name} cluster.dtype={dt} "
                               "engine.tp=1 engine.instances=8 'rows=[baseline,tail_batching]'"}

    if s.case("measure", measure):
        s.case("sim_loads", loads)


def predictor_mape(s: Section) -> dict:
    import jax

    import bench_adaptive_tp as bat
    from jaxrl.rollout.adaptive_tp import Predictor, Profile
    from jaxrl.rollout.service import RolloutService

    path = s.shared["out"] / PROFILE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the profile section wrote no profile")
    name, cfg, dtype, weights = _model(s)
    t = SMOKE_TRAJECTORY if s.smoke else TRAJECTORY
    svc = RolloutService.from_config(_engine(s), cfg, weights, devices=jax.devices()[:1])
    prompts, lens = bat.requests(t["requests"], 1, cfg.vocab_size, t["median"], t["max_new"])
    rows = bat.repeated(svc, prompts, lens, t["steps"], t["repeats"])
    mape = bat.mape(Predictor(Profile.load(path)), rows, 1)
    return {"value": mape, "target": MAPE_TARGET, "met": bool(mape <= MAPE_TARGET), "applies": not s.smoke,
            "steps": len(rows), "repeats": t["repeats"], "requests": t["requests"], "model": name}


def tail_batching(s: Section) -> dict:
    import bench_tail_batching as tb
    from models import PRESETS

    t = SMOKE_TAIL if s.smoke else TAIL
    args = argparse.Namespace(quick=s.smoke, eta=1.25, sigma=1.3, seed=0, **t,
                              peak_json=str(peak_json(s, s.shared["tmp"] / "peak.json")))
    original = tb.model_config
    if not s.smoke:                          # the script's own models are CPU-sized: the GPU-sized shape instead
        tb.model_config = lambda quick: PRESETS["qwen3-0.6b"]
    try:
        out = tb.run(args)
    finally:
        tb.model_config = original
    speedup = out["speedup"]
    return {"value": speedup, "target": TAIL_TARGET, "met": bool(speedup >= TAIL_TARGET), "applies": not s.smoke,
            "model": "qwen3-0.6b shape (float32)" if not s.smoke else "bench_tail_batching --quick model",
            "settings": t, "engine_step_ratio": out["engine_step_ratio"],
            "length_p99_over_median": out["length_p99_over_median"], "warmup_compiles": out["warmup_compiles"],
            "warmup_s": out["warmup_s"], "roofline_speedup": {k: v["speedup"] for k, v in out["roofline"].items()
                                                               if isinstance(v, dict)},
            **{k: {f: out[k][f] for f in ("seconds", "trained_prompts", "seconds_per_trained_prompt", "engine_steps",
                                          "decoded_tokens", "wasted_tokens")} for k in ("tail_batching", "sync")}}


def run_targets(s: Section) -> None:
    s.case("predictor_mape", predictor_mape, s)
    s.case("tail_batching", tail_batching, s)


def targets_table(sections: dict) -> list[dict]:
    """The targets as rows (name, value, target, met, applies) for the summary, from the targets section."""
    cases = (sections.get("targets") or {}).get("cases", {})
    rows = []
    for name, what in (("predictor_mape", "PAT predictor MAPE <= 4%"), ("tail_batching", "tail batching >= 2x sync")):
        c = cases.get(name, {})
        rows.append({"name": name, "what": what, "status": c.get("status", "not run"), "value": c.get("value"),
                     "target": c.get("target"), "met": c.get("met"), "applies": c.get("applies")})
    return rows

