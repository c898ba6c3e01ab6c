"""`python -m jaxrl.rollout.profile [key=value ...]`: PAT's offline profiler (paper §4.2), the input of
`jaxrl.rollout.adaptive_tp.Predictor`.

For the model and the rollout device pool (`engine.tp × engine.instances` devices), every candidate layout
(TP sizes that divide the pool and that the heads allow, or `candidates`) is measured on its first TP
group:

* decode: a grid of `batches` (10) batch sizes over [1, engine.max_batch] (geometric) × context lengths
  (denser below 512), kept where B·(L + decode_steps) ≤ T_cap, the instance's KV pool in tokens (from
  the engine's page budget). Per point, B random-token prompts of length L are prefilled (their prefill
  time recorded: T_prefill(B, L)), then `decode_steps` decode steps run back to back, each timed from the
  end of the one before, and their median kept (60 on a GPU as in the paper; fewer on the CPU by setting
  it), with the engine's own `overlap` (on: step n+1 is dispatched before n is read, so the time is the
  steady-state step with the host's work hidden). A step's context is L + its index, so the row is
  recorded at the mean context L + (decode_steps + 1) / 2. `passes` > 1 measures the whole grid that many
  times and keeps each point's median (a shared host's bursts of load then hit one pass of a point).
  `grid=shapes` (XLA decode path) replaces the batches x contexts grid with the shapes the engine runs: every
  rows bucket x one context inside each page-table width (`shape_grid`);
* shapes: with the XLA decode path, the padded decode shapes the layout's instances run (rows ladder,
  page-table widths), so the predictor can map a batch to the shape it actually runs (`adaptive_tp.Padded`);
* compile: the seconds to compile the layout's whole bounded step set on its first TP group, times the
  number of TP groups (executables are per device set; one host compiles them one after the other);
* between layouts: the weight reshard + rebuild of `relayout` with nothing live, per (src, dst) pair
  (`reshard_seconds`: the control overhead of a switch rides in it), and the KV migration bandwidth,
  calibrated so that Eq. 2 reproduces a measured (warm: the same move made once before) migration:
  B_net = S_kv^rank (Eq. 1 of the moved sequences) / the measured KV-move seconds;
* the controller's own time for one Algorithm 1 evaluation (`control_seconds`);
* per layout, how much its instances slow each other decoding at once (`contention`: at the middle context,
  the smallest and largest batch on every instance against instance 0 alone; ~0 on a GPU, near 1 where
  fake devices share the CPU's cores: the simulator's CPU model needs it).

The profile (JSON) is keyed by (model shape, device kind, dtype, pool size, engine shape, decode_steps)
and cached under `cache_dir`: a second run with the same key loads it (`force=true` re-measures). A PNG of
decode latency against context tokens per batch size and TP goes beside `out`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from jaxrl.config import parse_cli
from jaxrl.config.profile import ProfileConfig
from jaxrl.runtime import request_cpu_devices
from models import init, load_hf

from .adaptive_tp import LayoutProfile, Live, Predictor, Profile, SwitchController, by_group
from .params import SamplingParams
from .planner import candidate_tps
from .service import RolloutService


def batch_grid(max_batch: int, n: int = 10) -> list[int]:
    """`n` batch sizes over [1, max_batch], geometric (fewer when max_batch is small)."""
    return sorted({int(round(b)) for b in np.geomspace(1, max_batch, n)})


def context_grid(max_len: int) -> list[int]:
    """Context lengths denser below 512 (where latency is least linear), then doubling, up to max_len."""
    dense = [16, 32, 64, 96, 128, 192, 256, 384, 512]
    out = [x for x in dense if x <= max_len]
    x = 1024
    while x <= max_len:
        out.append(x)
        x *= 2
    return out or [max(1, max_len)]


def profile_key(model_cfg, device_kind: str, dtype: str, devices: int, engine: dict, decode_steps: int,
                method: dict | None = None) -> dict:
    """`method`: how the grid was measured ({"grid", "passes"}), when not the defaults (paper, 1)."""
    shape = json.dumps(dataclasses.asdict(model_cfg), sort_keys=True, default=str)
    key = {"model": hashlib.sha256(shape.encode()).hexdigest()[:16], "device": device_kind, "dtype": dtype,
           "devices": devices, "engine": engine, "decode_steps": decode_steps}
    if method and method != {"grid": "paper", "passes": 1}:
        key["method"] = method
    return key


def cache_path(cache_dir: str | Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return Path(cache_dir).expanduser() / f"profile-{digest}.json"


def _prompts(rng, batch: int, length: int, vocab: int) -> list[list[int]]:
    return [rng.integers(1, vocab, size=length).tolist() for _ in range(batch)]


def _timed_steps(svc, decode_steps: int, timer) -> float:
    """The median of `decode_steps` back-to-back decode steps, each timed from the end of the one before
    (a step returns with work still in flight; timing `step()` alone would miss it, and a gap between steps
    would hide it); the median, because a shared host stalls in bursts that a mean would average in."""
    times, t = [], timer()
    for _ in range(decode_steps):
        svc.step()
        now = timer()
        times.append(now - t)
        t = now
    return float(np.median(times))


def _start(svc, rng, batch: int, length: int, decode_steps: int, vocab: int, instances) -> list[int]:
    """`batch` random prompts of `length` tokens on each of `instances`, stepped until every one is running
    with its first token."""
    params = SamplingParams(max_new_tokens=decode_steps + 2, temperature=0.0, stop_token_ids=())
    rids = [svc.add(p, params, instance=i)[0] for i in instances for p in _prompts(rng, batch, length, vocab)]
    while True:
        svc.step()
        stats = {s["request_id"]: s for s in svc.sequence_stats()}
        if all(r in stats and stats[r]["generated"] >= 1 and stats[r]["state"] == "running" for r in rids):
            return rids


def _stop(svc, rids) -> None:
    svc.pause()
    for r in rids:
        svc.abort(r)


def measure_point(svc, rng, batch: int, length: int, decode_steps: int, vocab: int,
                  timer=time.perf_counter) -> tuple[float, float]:
    """(prefill seconds, seconds per decode step) of `batch` random prompts of `length` tokens on instance 0
    (`timer`: the clock read; the simulator profiles its cost model on its virtual one). With the engine's
    overlap (step n+1 in flight while n is read) the step is the steady-state one, host work hidden behind
    the device's; without, host + device."""
    t0 = timer()
    rids = _start(svc, rng, batch, length, decode_steps, vocab, [0])
    prefill = timer() - t0
    decode = _timed_steps(svc, decode_steps, timer)
    _stop(svc, rids)
    return prefill, decode


def _decode_time(svc, rng, batch: int, length: int, decode_steps: int, vocab: int, instances, timer) -> float:
    """Seconds per decode step with `batch` prompts of `length` tokens on each of `instances` (as in
    `measure_point`)."""
    rids = _start(svc, rng, batch, length, decode_steps, vocab, instances)
    out = _timed_steps(svc, decode_steps, timer)
    _stop(svc, rids)
    return out


def measure_contention(svc, rng, batches, length: int, decode_steps: int, vocab: int,
                       timer=time.perf_counter, repeats: int = 3) -> list[tuple[int, float]]:
    """`LayoutProfile.contention`: per batch size, κ = (t_all / t_one − 1) / (n − 1) from the decode step with
    every one of the layout's n instances busy (t_all) and with instance 0 alone (t_one), measured back to
    back, the median of `repeats`."""
    n = len(svc.instances)
    out = []
    for b in batches:
        ratios = []
        for _ in range(repeats):
            one = _decode_time(svc, rng, b, length, decode_steps, vocab, [0], timer)
            every = _decode_time(svc, rng, b, length, decode_steps, vocab, range(n), timer)
            ratios.append(every / one if one > 0 else 1.0)
        out.append((int(b), float(min(1.0, max(0.0, (float(np.median(ratios)) - 1) / (n - 1))))))
    return out


def token_cap(svc) -> int:
    """T_cap: the first instance's KV pool in tokens (its page budget)."""
    return svc.instances[0].sched.pool.capacity * svc.instance_kw["page_size"]


def fits(batch: int, length: int, decode_steps: int, cap: int, max_seq_len: int) -> bool:
    return batch * (length + decode_steps + 2) <= cap and length + decode_steps + 2 <= max_seq_len


def shape_grid(shapes, decode_steps: int) -> tuple[list[int], list[int]]:
    """The XLA decode path's grid (`grid=shapes`): every rows bucket, and per page-table width one context
    whose timed steps all run that width (the engine runs a finite set of padded shapes; this measures each
    one instead of points that fall between them)."""
    ps, pages = shapes.page_size, sorted(shapes.pages)
    contexts = []
    for prev, w in zip([0] + pages, pages):
        n = w * ps - decode_steps - 3              # the last timed step's context: w * ps - 2, the width's top
        if n >= 1 and (n + 1 + ps) // ps > prev:   # the first one's still past the narrower width
            contexts.append(n)
    return list(shapes.batch), contexts


def measure_layout(svc, tp: int, batches, contexts, decode_steps: int, vocab: int, rng, bar=None,
                   timer=time.perf_counter, contention: bool = True, passes: int = 1) -> LayoutProfile:
    """Compile time, then every (B, L) of the grid that fits T_cap on the layout's first TP group, `passes`
    times over the whole grid (each point: the median of its passes, so a burst of host load hits one pass of
    a point, not all of them), and, with `contention`, how much the layout's instances slow each other."""
    cap = token_cap(svc)
    t0 = timer()
    svc.instances[0].warm()                   # only the first TP group is measured
    # executables are per device set: a layout seen for the first time compiles its step set once per
    # instance (one after the other on one host)
    compile_s = (timer() - t0) * len(svc.instances)
    grid = [(b, n) for b in batches for n in contexts if fits(b, n, decode_steps, cap, svc.max_seq_len)]
    if bar is not None:
        bar.update(len(batches) * len(contexts) * passes - len(grid) * passes)
    runs: dict[tuple[int, int], list[tuple[float, float]]] = {g: [] for g in grid}
    for _ in range(passes):
        for b, n in grid:
            p, d = measure_point(svc, rng, b, n, decode_steps, vocab, timer)
            runs[b, n].append((p, d))
            if bar is not None:
                bar.update(1)
                bar.set_postfix(tp=tp, batch=b, context=n, ms=f"{d * 1e3:.2f}")
    pre = [(b, n, float(np.median([r[0] for r in runs[b, n]]))) for b, n in grid]
    dec = [(b, n + (decode_steps + 1) // 2, float(np.median([r[1] for r in runs[b, n]]))) for b, n in grid]
    sh = svc.instances[0].shapes
    shapes = None if svc.instance_kw["attention_impl"] != "xla" else \
        {"batch": list(sh.batch), "pages": list(sh.pages), "page_size": sh.page_size}
    contention: list = []
    if contention and dec and len(svc.instances) > 1:        # smallest and largest batch at the middle context
        mid = contexts[len(contexts) // 2]
        fit = [b for b in batches if fits(b, mid, decode_steps, cap, svc.max_seq_len)]
        if fit:
            contention = measure_contention(svc, rng, sorted({fit[0], fit[-1]}), mid, max(decode_steps, 16), vocab,
                                            timer)
    return LayoutProfile(tp, dec, pre, compile_s, shapes, contention)


def measure_switches(svc, tps: list[int], prof_layers: int, kv_bytes_per_token_layer: int, vocab: int, rng,
                     live_batch: int, live_len: int) -> tuple[dict[str, float], float]:
    """Weight reshard + rebuild seconds per (src, dst) with nothing live, and the migration bandwidth (Eq. 2
    calibrated on a relayout that moves `live_batch` sequences of `live_len` tokens)."""
    reshard = {}
    order = tps + tps[:1]
    for src in tps:
        for dst in tps:
            if src == dst:
                continue
            svc.relayout(src, len(svc.devices) // src)
            t0 = time.perf_counter()
            svc.relayout(dst, len(svc.devices) // dst)
            reshard[f"{src}->{dst}"] = time.perf_counter() - t0
    src, dst = order[0], order[1] if len(order) > 1 else order[0]
    svc.relayout(src, len(svc.devices) // src)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=())
    for k, p in enumerate(_prompts(rng, live_batch, live_len, vocab)):
        svc.add(p, params, instance=k % len(svc.instances))
    for _ in range(3):
        svc.step()
    svc.pause()
    live = [Live(s["context_len"], 0, s["instance"]) for s in svc.sequence_stats()]
    # the first migration of these page counts compiles its staging executables: move there and back once,
    # then time the same move warm
    svc.relayout(dst, len(svc.devices) // dst, kv="migrate")
    svc.relayout(src, len(svc.devices) // src, kv="migrate")
    report = svc.relayout(dst, len(svc.devices) // dst, kv="migrate")
    per_rank = max(sum(prof_layers * x.context * kv_bytes_per_token_layer for x in g) / src for g in by_group(live))
    bandwidth = per_rank / max(report.kv.seconds, 1e-9)
    for r in svc.live():
        svc.abort(r)
    return reshard, bandwidth


def run_profile(model_cfg, weights, engine, *, candidates=None, batches: int = 10, contexts=None,
                decode_steps: int = 60, seed: int = 0, progress: bool = True, grid: str = "paper",
                passes: int = 1) -> Profile:
    """Measure every candidate layout of `engine`'s pool (an `EngineSection`: its tp x instances devices,
    page budget and shapes) and the switches between them. `grid`: "paper" (`batches` geometric batch sizes
    x `contexts`) or "shapes" (the XLA decode path's own padded shapes: `shape_grid`); `passes`: times the
    grid is measured (each point's median)."""
    if grid not in ("paper", "shapes"):
        raise ValueError(f"grid must be 'paper' or 'shapes', got {grid!r}")
    devices = engine.num_devices
    tps = sorted(candidates) if candidates else candidate_tps(devices, model_cfg)
    total_batch = engine.max_batch * engine.instances
    rng = np.random.default_rng(seed)
    max_batch = {tp: max(1, total_batch // (devices // tp)) for tp in tps}
    ctx = sorted(contexts) if contexts else context_grid(engine.max_seq_len - decode_steps - 2)
    layouts = {}
    with tqdm(total=0, desc="profile", unit="pt", file=sys.stderr, disable=not progress) as bar:
        for tp in tps:
            svc = RolloutService.from_config(dataclasses.replace(engine, tp=tp, instances=devices // tp,
                                                                 max_batch=max_batch[tp]),
                                             model_cfg, weights, devices=jax.devices()[:devices])
            bs, cs = batch_grid(max_batch[tp], batches), ctx
            if grid == "shapes" and svc.instance_kw["attention_impl"] == "xla":
                bs, cs = shape_grid(svc.instances[0].shapes, decode_steps)
            bar.total += len(bs) * len(cs) * passes
            bar.refresh()
            layouts[tp] = measure_layout(svc, tp, bs, cs, decode_steps, model_cfg.vocab_size, rng, bar,
                                         passes=passes)
            del svc
    itemsize = np.dtype(jax.tree.leaves(weights)[0].dtype).itemsize
    kv_tok = 2 * model_cfg.num_kv_heads * model_cfg.head_dim * itemsize
    svc = RolloutService.from_config(dataclasses.replace(engine, tp=tps[0], instances=devices // tps[0],
                                                         max_batch=max_batch[tps[0]]),
                                     model_cfg, weights, devices=jax.devices()[:devices])
    live_len = max(1, min(ctx[len(ctx) // 2], engine.max_seq_len - 10))     # + 8 new tokens fit max_seq_len
    live_batch = max(1, min(total_batch, token_cap(svc) // (live_len + 10)))
    reshard, bandwidth = measure_switches(svc, tps, model_cfg.num_layers, kv_tok, model_cfg.vocab_size, rng,
                                          live_batch, live_len)
    key = profile_key(model_cfg, jax.devices()[0].device_kind, str(jax.tree.leaves(weights)[0].dtype), devices,
                      {"page_size": engine.page_size, "max_batch": engine.max_batch, "instances": engine.instances,
                       "max_seq_len": engine.max_seq_len, "kv_bytes_per_device": engine.kv_bytes_per_device,
                       "num_pages": engine.num_pages}, decode_steps, {"grid": grid, "passes": passes})
    prof = Profile(key, layouts, bandwidth, reshard, model_cfg.num_layers, kv_tok)
    prof.control_seconds = control_overhead(prof, tps, devices)
    return prof


def control_overhead(prof: Profile, tps: list[int], devices: int, repeats: int = 20) -> float:
    """Seconds of one Algorithm 1 evaluation over a full batch of live sequences (the controller's own cost)."""
    ctl = SwitchController(Predictor(prof), tps, devices)
    live = [Live(256, 256, k % (devices // tps[0])) for k in range(64)]
    t0 = time.perf_counter()
    for _ in range(repeats):
        ctl.decide(tps[0], live)
    return (time.perf_counter() - t0) / repeats


def plot(prof: Profile, path: Path) -> None:
    """Decode latency against context tokens, one panel per TP, one line per batch size."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tps = sorted(prof.layouts)
    fig, axes = plt.subplots(1, len(tps), figsize=(4 * len(tps), 3.2), sharey=True, squeeze=False)
    for ax, tp in zip(axes[0], tps):
        rows = prof.layouts[tp].decode
        for b in sorted({r[0] for r in rows}):
            pts = sorted((r[0] * r[1], r[2] * 1e3) for r in rows if r[0] == b)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=f"B={b}")
        ax.set_xscale("log")
        ax.set_title(f"TP {tp}")
        ax.set_xlabel("context tokens T")
    axes[0][0].set_ylabel("decode step (ms)")
    axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    cfg = parse_cli(ProfileConfig, argv, prog="python -m jaxrl.rollout.profile")
    e = cfg.engine
    request_cpu_devices(e.num_devices)
    model_cfg = cfg.model.model_config()
    engine_key = {"page_size": e.page_size, "max_batch": e.max_batch, "instances": e.instances,
                  "max_seq_len": e.max_seq_len, "kv_bytes_per_device": e.kv_bytes_per_device, "num_pages": e.num_pages}
    key = profile_key(model_cfg, jax.devices()[0].device_kind, cfg.model.dtype, e.num_devices, engine_key,
                      cfg.decode_steps, {"grid": cfg.grid, "passes": cfg.passes})
    cached = cache_path(cfg.cache_dir, key)
    out = Path(cfg.out).absolute()
    if cached.exists() and not cfg.force:
        prof = Profile.load(cached)
        print(f"profile: cached {cached} (force=true re-measures)", file=sys.stderr)
    else:
        if cfg.model.hf_path:
            _, weights = load_hf(cfg.model.hf_path, dtype=cfg.model.jnp_dtype())
        else:
            weights = init(jax.random.key(0), model_cfg, cfg.model.jnp_dtype())
        prof = run_profile(model_cfg, weights, e, candidates=cfg.candidates, batches=cfg.batches,
                           contexts=cfg.contexts, decode_steps=cfg.decode_steps, seed=cfg.seed, grid=cfg.grid,
                           passes=cfg.passes)
        prof.key = key
        cached.parent.mkdir(parents=True, exist_ok=True)
        prof.save(cached)
    out.parent.mkdir(parents=True, exist_ok=True)
    prof.save(out)
    plot(prof, out.with_suffix(".png"))
    n = sum(len(lp.decode) for lp in prof.layouts.values())
    print(f"profile: {n} decode points over TP {sorted(prof.layouts)}, migration {prof.migrate_bytes_per_s / 1e9:.2f} "
          f"GB/s per rank; wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
