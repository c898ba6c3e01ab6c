"""Where a GRPO step's time goes on the real model (SmolLM2-135M-Instruct, float32): the profile behind
docs/benchmarks.md's real-model section and `scripts/bench_e2e.py`'s REAL_TRAIN overrides.

    python scripts/bench_real_profile.py                  # -> scripts/results/bench_real_profile.json (~8 min)
    python scripts/bench_real_profile.py --quick --out /tmp/p.json    # 2 layers, 2 train variants, short timing

The workload is bench_e2e.py's "smollm2" step: 32 sequences of a 40-token chat prompt and a 42-token response
(its measured mean; 82 of the pack length 96, so one sequence a packed row), the update on one device.

**Train** (`train`): the gradient program `jaxrl.train.step.make_grad_step` builds, on one micro-batch per
call, for the trainer's choices that change its speed and nothing else (tests/test_train_step.py holds the
equalities): `trainer.remat` (dots, the default; layer; none) x the micro-batch shape
(`trainer.micro_batch_tokens`: 2048, the default, splits the 32 rows into 2 micro-batches of 21 rows = 4032
tokens computed; 3072 runs the whole batch as one of 32 rows). Seconds per update = the micro-batches' calls
summed (the optimizer's update, the same for every variant, is left out), interleaved over `--repeats`
rounds, the best kept; FLOP/s as computed (`bench_e2e.train_flops`: every row's 96 positions, the LM head on
the response tokens) against the float32 matmul peak measured at the start.

**Threads** (`threads`): one update of the fastest variant under `jax.profiler`, each XLA:CPU worker thread's
op events laid on one time line: the seconds both cores ran an op, one did, none did (the host between ops),
and the ops that ran alone the longest. XLA:CPU runs independent ops of a program at once, one core each; a
matmul that starts while the other core is busy keeps to its core to the end.

**Decode** (`decode`): one token for 32 rows at context 60, on one device: the engine's own step
(`jaxrl.rollout.model_step.decode_step`: paged attention, KV writes, sampling at temperature 1), the decoder
stack with the attention replaced by a copy of V (what the layers' matmuls and elementwise work cost), the same
with the layers as a Python list of per-layer weights instead of the stacked scan (what slicing the stacked
weights costs), and the LM head alone. The roofline is the larger of reading the float32 weights once (read
bandwidth measured at the start) and the step's matmuls at the peak.
"""

from __future__ import annotations

import argparse
import collections
import glob
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]

from jaxrl.runtime import cpu_compile_level  # noqa: E402

cpu_compile_level()     # the level `python -m jaxrl.train` compiles at

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import bench_e2e  # noqa: E402
import bench_e2e_workload as workload  # noqa: E402
from bench_harness import write_result  # noqa: E402

DEFAULT_OUT = HERE / "results" / "bench_real_profile.json"
OUTPUTS = ("bench_real_profile.json",)
SEQS, PROMPT, RESPONSE, PACK = 32, 40, 42, 96
VARIANTS = [("dots", 21, 2), ("layer", 21, 2), ("dots", 32, 1), ("layer", 32, 1), ("none", 32, 1)]  # remat, rows, calls
QUICK_VARIANTS = [VARIANTS[0], VARIANTS[3]]      # --quick: the default and the chosen one
DECODE_CONTEXT = 60


def load_model(quick: bool, model: Path | None = None):
    """The real model's config and float32 weights (`model`: a converted directory; default
    bench_e2e_workload's, fetched when missing); `quick`: its first two layers."""
    from models import load_hf
    from models.fetch import fetch

    cfg, w = load_hf(fetch(workload.REAL_MODEL, model or workload.REAL_CHECKPOINT), dtype=jnp.float32)
    if quick:               # the first two layers: the same shapes per layer, a fifteenth of the work
        import dataclasses

        cfg = dataclasses.replace(cfg, num_layers=2)
        w = type(w)(embed=w.embed, layers=jax.tree.map(lambda a: a[:2], w.layers), final_norm=w.final_norm,
                    lm_head=w.lm_head)
    return cfg, w


def micro_batch(rows: int, vocab: int, seed: int = 0) -> dict:
    """`rows` packed rows of one sequence each: PROMPT + RESPONSE real tokens, then padding (segment 0)."""
    rng = np.random.default_rng(seed)
    seq = PROMPT + RESPONSE
    tokens = rng.integers(3, vocab, (rows, PACK)).astype(np.int32)
    seg = np.zeros((rows, PACK), np.int32)
    seg[:, :seq] = 1
    mask = np.zeros((rows, PACK), bool)
    mask[:, PROMPT - 1:seq - 1] = True
    return {k: jnp.asarray(v) for k, v in dict(
        tokens=tokens, positions=np.tile(np.arange(PACK, dtype=np.int32), (rows, 1)), segment_ids=seg,
        targets=np.roll(tokens, -1, axis=1), loss_mask=mask,
        advantages=rng.normal(size=(rows, PACK)).astype(np.float32),
        weights=np.full((rows, PACK), 1.0 / (SEQS * RESPONSE), np.float32)).items()}


def best_of(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - t)
    return out


def train_profile(cfg, w, peak: dict, repeats: int, variants=VARIANTS) -> list[dict]:
    from jaxrl.train.step import LossSpec, make_grad_step

    progs = {}
    for remat, rows, calls in variants:
        b = micro_batch(rows, cfg.vocab_size)
        t = time.perf_counter()
        c = make_grad_step(cfg, LossSpec(remat=remat)).lower(w, b).compile()
        progs[(remat, rows, calls)] = (c, b, time.perf_counter() - t)
        jax.block_until_ready(c(w, b))                                      # the first call, untimed
    times = {k: [] for k in progs}
    for _ in range(repeats):                                                # interleaved rounds
        for k, (c, b, _) in progs.items():
            times[k] += [sum(best_of(lambda: c(w, b), 1)[0] for _ in range(k[2]))]
    out = []
    for (remat, rows, calls), ts in times.items():
        flops = calls * bench_e2e.train_flops(cfg, rows, PACK, rows * RESPONSE)
        ideal = bench_e2e.train_flops(cfg, SEQS, PROMPT + RESPONSE, SEQS * RESPONSE)
        s = min(ts)
        out.append(dict(remat=remat, rows=rows, micro_batches=calls, tokens_computed=calls * rows * PACK,
                        seconds=s, seconds_all=ts, compile_s=progs[(remat, rows, calls)][2],
                        computed_gflop=flops / 1e9, computed_fraction=flops / s / 1e9 / peak["gflops"],
                        ideal_fraction=ideal / s / 1e9 / peak["gflops"]))
        print(f"[profile] train remat={remat} {calls} x {rows} rows: {s:.2f} s, "
              f"{100 * out[-1]['computed_fraction']:.0f}% of peak as computed", flush=True)
    return out


def thread_timeline(trace_dir: Path) -> dict:
    """Seconds with 2 / 1 / 0 XLA:CPU worker threads running an op, and the longest-running lone ops."""
    from xprof.profile_data import ProfileData

    skip = ("ThunkExecutor", "Slinky", "ThreadpoolListener", "end:")
    per = []
    with ProfileData.from_file(sorted(glob.glob(str(trace_dir / "**" / "*.xplane.pb"), recursive=True))[-1]) as pd:
        for plane in pd.planes:
            for line in plane.lines:
                if "Eigen" in line.name:
                    per.append([(e.start_ns, e.start_ns + e.duration_ns, e.name) for e in line.events
                                if not e.name.startswith(skip)])
    points = sorted((t, d, i, n) for i, evs in enumerate(per) for s, e, n in evs for t, d in ((s, 1), (e, -1)))
    active, current = [0] * len(per), [None] * len(per)
    busy, alone, last = collections.Counter(), collections.Counter(), points[0][0]
    for t, d, i, n in points:
        running = [j for j, a in enumerate(active) if a > 0]
        busy[len(running)] += t - last
        if len(running) == 1:
            alone[current[running[0]].split(".")[0]] += t - last
        last = t
        active[i] += d
        current[i] = n if d > 0 else current[i]
    return dict(threads=len(per), seconds_by_busy_threads={str(k): v / 1e9 for k, v in sorted(busy.items())},
                alone_by_op={k: v / 1e9 for k, v in alone.most_common(6)})


def threads_profile(cfg, w, remat: str, rows: int) -> dict:
    from jaxrl.train.step import LossSpec, make_grad_step

    b = micro_batch(rows, cfg.vocab_size)
    c = make_grad_step(cfg, LossSpec(remat=remat)).lower(w, b).compile()
    jax.block_until_ready(c(w, b))
    d = Path(tempfile.mkdtemp(prefix="real_profile_trace-"))
    jax.profiler.start_trace(str(d))
    t = time.perf_counter()
    jax.block_until_ready(c(w, b))
    wall = time.perf_counter() - t
    jax.profiler.stop_trace()
    out = dict(remat=remat, rows=rows, wall_s=wall, **thread_timeline(d))
    print(f"[profile] threads: {out['seconds_by_busy_threads']}", flush=True)
    return out


def decode_programs(cfg, w):
    """{name: (jitted fn, args)} of the decode variants (module docstring)."""
    from jaxrl.rollout.model_step import DecodeInputs, decode_step
    from jaxrl.rollout.sampling import SamplingBatch
    from models import decoder_layer, decoder_stack, lm_head
    from models import layers as L

    B, ps = SEQS, 16
    mp = -(-(DECODE_CONTEXT + 1) // ps)
    shape = (cfg.num_layers, 1 + B * mp, cfg.num_kv_heads, ps, cfg.head_dim)
    k_pages, v_pages = jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32)
    table = (1 + np.arange(B * mp, dtype=np.int32)).reshape(B, mp)
    tokens = np.arange(3, 3 + B, dtype=np.int32)
    positions = np.full(B, DECODE_CONTEXT, np.int32)
    sb = SamplingBatch(temperature=np.ones(B, np.float32), top_k=np.zeros(B, np.int32),
                       top_p=np.ones(B, np.float32), seed=np.arange(B, dtype=np.uint32), step=np.zeros(B, np.int32))
    inputs = DecodeInputs.pack(np.full(B, -1, np.int32), tokens, positions, table, sb)
    prev = jnp.zeros(B, jnp.int32)
    engine = jax.jit(lambda w, kp, vp: decode_step(w, kp, vp, prev, inputs, cfg=cfg)[:2])

    def copy_v(l, q, k, v, carry, _):
        return jnp.repeat(v, cfg.num_heads // cfg.num_kv_heads, axis=2), carry, None

    tok, pos = jnp.asarray(tokens), jnp.asarray(positions)

    @jax.jit
    def stacked(w):
        h, _, _ = decoder_stack(w, cfg, w.embed[tok[:, None]], pos[:, None], copy_v)
        return h[:, 0] @ lm_head(w)

    per_layer = [jax.tree.map(lambda a, i=i: a[i], w.layers) for i in range(cfg.num_layers)]

    @jax.jit
    def listed(layers, embed, final_norm):
        x = embed[tok[:, None]]
        for i, layer in enumerate(layers):
            x, _, _ = decoder_layer(layer, cfg, x, pos[:, None], copy_v, i)
        return L.rms_norm(x, final_norm, cfg.rms_norm_eps)[:, 0] @ embed.T

    head = jax.jit(lambda w: w.embed[tok] @ lm_head(w))
    return {"engine decode_step": (engine, (w, k_pages, v_pages)), "layers, stacked scan": (stacked, (w,)),
            "layers, per-layer list": (listed, (per_layer, w.embed, w.final_norm)), "LM head alone": (head, (w,))}


def decode_profile(cfg, w, peak: dict, repeats: int, calls: int = 10) -> dict:
    progs = decode_programs(cfg, w)
    for fn, args in progs.values():
        jax.block_until_ready(fn(*args))
    times = {k: [] for k in progs}
    for _ in range(repeats):
        for k, (fn, args) in progs.items():
            times[k] += best_of(lambda: fn(*args), calls)
    N = bench_e2e._matmul_weights(cfg)
    E, V = cfg.hidden_size, cfg.vocab_size
    flops = SEQS * (2 * N + 2 * E * V + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * DECODE_CONTEXT)
    read = 4 * (N + E * V) / (peak["read_gbs"] * 1e9)
    roofline = max(read, flops / (peak["gflops"] * 1e9))
    steps = {k: dict(ms=statistics.median(ts) * 1e3, ms_min=min(ts) * 1e3) for k, ts in times.items()}
    for k, s in steps.items():
        print(f"[profile] decode {k}: {s['ms']:.1f} ms (roofline {roofline * 1e3:.1f} ms)", flush=True)
    return dict(rows=SEQS, context=DECODE_CONTEXT, steps=steps, roofline_ms=roofline * 1e3, weight_read_ms=read * 1e3,
                matmul_ms=flops / (peak["gflops"] * 1e9) * 1e3,
                engine_roofline_ratio=steps["engine decode_step"]["ms"] / (roofline * 1e3))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 layers of the model, 1 round (smoke test)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds per measurement")
    ap.add_argument("--model", type=Path, default=None,
                    help=f"the converted model directory (default {workload.REAL_CHECKPOINT}, fetched when missing)")
    args = ap.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    timing = dict(min_seconds=0.1, repeats=1) if args.quick else {}
    peak = dict(bench_e2e.peak_gflops(**timing), read_gbs=bench_e2e.read_bandwidth_gbs(64 if args.quick else 256, **timing))
    cfg, w = load_model(args.quick, args.model)
    train = train_profile(cfg, w, peak, repeats, QUICK_VARIANTS if args.quick else VARIANTS)
    fastest = min(train, key=lambda r: r["seconds"])
    result = dict(model=workload.REAL_MODEL, layers=cfg.num_layers, quick=args.quick, peak=peak,
                  workload=dict(sequences=SEQS, prompt=PROMPT, response=RESPONSE, pack_len=PACK), train=train,
                  threads=threads_profile(cfg, w, fastest["remat"], fastest["rows"]),
                  decode=decode_profile(cfg, w, peak, repeats, 2 if args.quick else 10))
    write_result(args.out, result)
    print(f"[profile] wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
